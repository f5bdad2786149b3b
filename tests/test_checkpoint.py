"""Checkpoints: any device count, crash safety, clear errors, donation after async save."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_close, awkward_loss, awkward_params, batches, make_mesh

import zeroshard as zs

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")


def worker(*args, timeout=300):
    return subprocess.run(
        [sys.executable, WORKER, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def test_save_on_8_resume_on_8_4_2_1_devices(tmp_path):
    ckpt = tmp_path / "ckpt"
    worker(8, ckpt, "run", 6, tmp_path / "uninterrupted.npz")
    assert zs.CheckpointManager(ckpt).all_steps() == [3]
    expected = load(tmp_path / "uninterrupted.npz")
    # One process restores on meshes of 8, 4, 2 and 1 of its devices, each mesh in turn.
    worker(8, ckpt, "resume", 6, tmp_path / "resumed{}.npz", "8,4,2,1")
    for m in (8, 4, 2, 1):
        got = load(tmp_path / f"resumed{m}.npz")
        if m == 8:  # the same program on the same state: bit-identical
            for a, b in zip(got, expected, strict=True):
                np.testing.assert_array_equal(a, b)
        else:  # another reduction order: fp32 rounding
            assert_trees_close(got, expected, 1e-5)


def test_sigkill_during_save_keeps_the_previous_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    for _ in range(3):  # retried only if the save finished before the kill landed
        if ckpt.exists():
            for root, dirs, files in os.walk(ckpt, topdown=False):
                for f in files:
                    os.remove(os.path.join(root, f))
                for d in dirs:
                    os.rmdir(os.path.join(root, d))
        proc = subprocess.Popen(
            [sys.executable, WORKER, "8", str(ckpt), "crash"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            for line in proc.stdout:
                if line.startswith("SAVING"):
                    proc.send_signal(signal.SIGKILL)
                    break
        finally:
            proc.kill()
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        steps = zs.CheckpointManager(ckpt).all_steps()
        if steps == [1]:
            break
    assert steps == [1], "the kill never landed during a save"
    # The half-written step 2 is on disk, but only as orbax's temporary directory.
    assert any(name.startswith("2.") for name in os.listdir(ckpt)), os.listdir(ckpt)
    # The run resumes from step 1 with nothing lost.
    rng = np.random.default_rng(0)
    params = awkward_params(rng)
    params["big"] = jnp.zeros((4096, 2048), jnp.float32)
    tx = zs.sharded(
        optax.chain(zs.clip_by_global_norm(0.5, axis_name="data"), optax.adamw(1e-2)),
        axis_name="data",
    )
    state = zs.CheckpointManager(ckpt, tx).restore(make_mesh(8), like=params)
    assert int(state.step) == 1
    assert float(jnp.abs(state.params["big"]).sum()) > 0  # the trained weights, not zeros


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """A 2-step adamw run on 8 devices saved at step 2 (bf16 compute, fp32 master)."""
    rng = np.random.default_rng(0)
    params, mesh = awkward_params(rng), make_mesh(8)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in batches(rng, 2):
        state, _ = train_step(state, batch)
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    ckpt = zs.CheckpointManager(directory, tx)
    ckpt.save(state)
    ckpt.wait_until_finished()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    return directory, tx, state, like


@pytest.fixture
def saved(saved_once, tmp_path):
    """``saved_once``'s checkpoint copied for one test (which may damage its files)."""
    directory, *rest = saved_once
    shutil.copytree(directory, tmp_path / "ckpt")
    return tmp_path / "ckpt", *rest


def snapshot(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_same_device_count_restore_is_bit_identical(saved):
    directory, tx, state, like = saved
    restored = zs.CheckpointManager(directory, tx).restore(make_mesh(8), like=like)
    same = lambda t: (t.step, t.params, t.opt_state.inner_state, t.opt_state.master)
    for a, b in zip(snapshot(same(restored)), snapshot(same(state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_on_disk_layout_is_plain_optax(saved):
    """A plain orbax + optax user restores it with their own target tree."""
    directory, _, state, like = saved
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), like)
    target = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": params,
        "opt_state": jax.eval_shape(optax.adamw(1e-2).init, params),
    }
    with ocp.CheckpointManager(directory) as mngr:
        raw = mngr.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
            "state"
        ]
    assert int(raw["step"]) == 2
    assert raw["opt_state"][0].mu["out"]["w"].shape == (13, 5)
    # The bf16 params are exactly the saved fp32 master rounded.
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(raw["params"]), strict=True):
        np.testing.assert_array_equal(p, m.astype(jnp.bfloat16))


def test_async_save_then_donation_is_safe(tmp_path, rng):
    params, mesh, data = awkward_params(rng), make_mesh(8), batches(rng, 3)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    state, _ = train_step(zs.init_train_state(params, tx, mesh), data[0])
    before = snapshot(zs.to_optax_state(state, tx))
    ckpt = zs.CheckpointManager(tmp_path / "ckpt", tx)
    ckpt.save(state)
    for batch in data[1:]:  # donates the saved state's buffers while orbax writes
        state, _ = train_step(state, batch)
    ckpt.wait_until_finished()
    restored = ckpt.restore(mesh, like=params)
    for a, b in zip(snapshot(zs.to_optax_state(restored, tx)), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_max_to_keep_and_latest_step(tmp_path, rng):
    params, mesh = awkward_params(rng), make_mesh(2)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    state = zs.init_train_state(params, tx, mesh)
    with zs.CheckpointManager(tmp_path, tx, max_to_keep=2) as ckpt:
        for batch in batches(rng, 3):
            state, _ = train_step(state, batch)
            ckpt.save(state)
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
        with pytest.raises(ValueError, match="already saved.*nothing was overwritten"):
            ckpt.save(state)
        assert ckpt.metadata(2)["step"] == 2


def listing(directory):
    return {
        os.path.join(root, f): os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(directory)
        for f in files
    }


def test_missing_and_empty_directories(tmp_path, rng):
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    like = awkward_params(rng)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        zs.CheckpointManager(tmp_path / "missing", tx).restore(make_mesh(8), like=like)
    assert not (tmp_path / "missing").exists()  # restoring created nothing
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no finalised checkpoint"):
        zs.CheckpointManager(tmp_path / "empty", tx).restore(make_mesh(8), like=like)


def test_another_model_names_the_first_mismatching_path(saved):
    directory, tx, _, like = saved
    before = listing(directory)
    other = dict(like, out={"w": jax.ShapeDtypeStruct((13, 6), jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"parameter \['out'\]\['w'\] is bfloat16\[13, 5\]"):
        zs.CheckpointManager(directory, tx).restore(make_mesh(8), like=other)
    extra = dict(like, extra=jax.ShapeDtypeStruct((3,), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"parameter \['extra'\] is missing in the checkpoint"):
        zs.CheckpointManager(directory, tx).restore(make_mesh(8), like=extra)
    assert listing(directory) == before


def test_dtype_or_optimizer_mismatch(saved):
    directory, tx, _, like = saved
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), like)
    with pytest.raises(
        ValueError,
        match=r"parameter \['dense'\]\['b'\] is bfloat16\[13\] in the checkpoint but float32\[13\]",
    ):
        zs.CheckpointManager(directory, tx).restore(make_mesh(8), like=f32)
    sgd = zs.sharded(optax.sgd(0.1, momentum=0.9), axis_name="data")
    with pytest.raises(ValueError, match="optimizer state leaf"):
        zs.CheckpointManager(directory, sgd).restore(make_mesh(8), like=like)
    no_master = zs.sharded(optax.adamw(1e-2), axis_name="data", master_dtype=None)
    with pytest.raises(
        ValueError, match=r"master weight .* is float32\[13\] in the checkpoint but bfloat16"
    ):
        zs.CheckpointManager(directory, no_master).restore(make_mesh(8), like=like)


def test_truncated_file_is_a_clear_error_and_nothing_is_overwritten(saved):
    directory, tx, _, like = saved
    files = listing(directory / "2" / "state" / "d")  # the array data of the finalised step
    biggest = max(files, key=files.get)
    with open(biggest, "r+b") as f:
        f.truncate(files[biggest] // 2)
    before = listing(directory)
    with pytest.raises(ValueError, match="truncated or corrupted"):
        zs.CheckpointManager(directory, tx).restore(make_mesh(8), like=like)
    assert listing(directory) == before


def test_inspect_prints_metadata_without_loading_arrays(saved):
    directory, *_ = saved
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "inspect", str(directory)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "saved on 8 devices along axis 'data'" in out
    assert "['out']['w']: [13, 5] bfloat16 -> float32" in out
    assert "[0].mu['out']['w']: [13, 5] float32" in out
    missing = subprocess.run(
        [sys.executable, "-m", "zeroshard", "inspect", str(directory / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "no checkpoint directory" in missing.stderr


# Integrity: checksums recorded at save, verified at restore on any device count.


def digest(directory):
    """Every file's bytes: restoring and verifying must change nothing on disk."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), directory)] = fh.read()
    return out


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Steps 1 and 2 of an adamw run on 8 devices, with a leaf big enough that orbax
    writes its values to a data file of their own (small ones are inlined in the
    CRC-checked b-tree nodes)."""
    rng = np.random.default_rng(0)
    params = awkward_params(rng)
    params["big"] = jnp.asarray(rng.normal(size=(256, 256)), jnp.float32)
    mesh, tx = make_mesh(8), zs.sharded(optax.adamw(1e-2), axis_name="data")
    loss_fn = lambda p, b: awkward_loss(p, b) + 1e-3 * jnp.sum(p["big"] ** 2)
    train_step = zs.make_train_step(loss_fn, tx, mesh)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    directory = tmp_path_factory.mktemp("two_steps") / "ckpt"
    with zs.CheckpointManager(directory, tx, max_to_keep=None) as ckpt:
        for batch in batches(rng, 2):
            state, _ = train_step(state, batch)
            ckpt.save(state)
            # One save at a time: how orbax lays the values out in its data files
            # (which the tests below damage) must not depend on the machine's load.
            ckpt.wait_until_finished()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    return directory, tx, snapshot(zs.to_optax_state(state, tx)), like


def damage(directory, path, copy_to):
    """A copy of ``directory`` with 4 bytes flipped in the middle of ``path``."""
    shutil.copytree(directory, copy_to)
    target = copy_to / os.path.relpath(path, directory)
    data = bytearray(target.read_bytes())
    for k in range(4):
        data[len(data) // 2 + k] ^= 0xFF
    target.write_bytes(bytes(data))
    return copy_to


def data_files(directory, step):
    root = directory / str(step) / "state"
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name == "d")


def value_files(directory, step):
    """The files that hold step ``step``'s array values: orbax writes them under
    ocdbt.process_*/d (state/d holds the merged index that points to them). How many,
    and which is largest, varies from run to run under load."""
    return [p for p in data_files(directory, step) if p.parent.parent.name != "state"]


def caught_by_checksum(directory, tx, like, tmp_path):
    """A value file of step 2 whose damage orbax reads without complaint and only
    zeroshard's checksums catch, tried largest first (which files orbax writes, and
    how large, varies from run to run under load)."""
    files = sorted(value_files(directory, 2), key=lambda p: -p.stat().st_size)
    for i, path in enumerate(files):
        copy = damage(directory, path, tmp_path / f"probe{i}")
        try:
            zs.CheckpointManager(copy, tx).restore(make_mesh(8), like=like)
        except zs.CheckpointCorruptedError as e:
            if re.search(r"checksum of (\S+) read from disk", str(e)):
                return path
    raise AssertionError(f"no damaged value file was caught by the checksums: {files}")


def test_undamaged_step_restores_bit_identically_on_8_4_1(two_steps):
    directory, tx, logical, like = two_steps
    for m in (8, 4, 1):
        restored = zs.CheckpointManager(directory, tx).restore(make_mesh(m), like=like)
        for a, b in zip(snapshot(zs.to_optax_state(restored, tx)), logical, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_damaged_byte_in_any_data_file_is_refused_on_8_4_1(two_steps, tmp_path):
    """Each data file of step 2 in turn: a restore on 8, 4 or 1 devices either refuses
    with the error that names the step, the leaf and the other steps, or, where orbax
    never reads the damaged bytes, restores exactly what was saved. The values of
    every leaf are read from the files that are refused."""
    directory, tx, logical, like = two_steps
    files = data_files(directory, 2)
    assert len(files) >= 3
    refused, by_checksum = set(), set()
    for i, path in enumerate(files):
        copy = damage(directory, path, tmp_path / f"copy{i}")
        before = digest(copy)
        for m in (8, 4, 1):
            try:
                restored = zs.CheckpointManager(copy, tx).restore(make_mesh(m), like=like)
            except zs.CheckpointCorruptedError as e:
                refused.add(path)
                message = str(e)
                assert f"step 2 of {copy}" in message and "Other steps: [1]" in message
                assert "corrupted" in message and "Nothing on disk was changed" in message
                checksum = re.search(r"checksum of (\S+) read from disk", message)
                if checksum:
                    by_checksum.add(path)
                    assert checksum[1].startswith(("params[", "opt_state["))
                continue
            for a, b in zip(snapshot(zs.to_optax_state(restored, tx)), logical, strict=True):
                np.testing.assert_array_equal(a, b)  # the damaged bytes were not read
        assert digest(copy) == before
    # Without checksums, a file with the leaves' values restored wrong values.
    assert by_checksum and by_checksum <= set(value_files(directory, 2))
    # Every file of the merged database that restores read (state/d/) is refused.
    assert {p for p in files if p.parent.parent.name == "state"} <= refused


def test_files_never_read_at_restore_are_the_per_process_copies(two_steps, tmp_path):
    """What restores exactly after damage: orbax's per-process databases are merged
    into state/d at save; restore reads the merged one and the files it points to."""
    directory, tx, logical, like = two_steps
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    for path in data_files(copy, 2):
        if "ocdbt.process_" in str(path) and path.stat().st_size < 4096:  # b-tree nodes
            path.unlink()
    restored = zs.CheckpointManager(copy, tx).restore(make_mesh(8), like=like)
    for a, b in zip(snapshot(zs.to_optax_state(restored, tx)), logical, strict=True):
        np.testing.assert_array_equal(a, b)


def test_latest_valid_is_explicit_and_says_what_it_skipped(two_steps, tmp_path, caplog):
    directory, tx, _, like = two_steps
    copy = damage(directory, caught_by_checksum(directory, tx, like, tmp_path), tmp_path / "copy")
    ckpt = zs.CheckpointManager(copy, tx)
    with pytest.raises(zs.CheckpointCorruptedError, match="step 2 of .*corrupted"):
        ckpt.restore(make_mesh(8), like=like)  # the default never falls back
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        state = ckpt.restore(make_mesh(8), like=like, step="latest_valid")
    (record,) = [r for r in caplog.records if r.name.startswith("zeroshard")]
    assert record.name == "zeroshard.checkpointing.manager"
    assert record.levelno == logging.WARNING
    assert re.search(r"restored step 1, the newest .* skipped: step 2 of", record.getMessage())
    assert int(state.step) == 1
    assert ckpt.all_steps() == [1, 2]  # nothing deleted


def test_a_step_saved_without_checksums_restores_with_a_warning(two_steps, tmp_path, caplog):
    directory, tx, _, like = two_steps
    copy = tmp_path / "old"
    shutil.copytree(directory, copy)
    record = copy / "2" / "zeroshard" / "metadata"
    meta = json.loads(record.read_text())
    del meta["checksums"], meta["record_sha256"]  # as zeroshard wrote it before them
    record.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        state = zs.CheckpointManager(copy, tx).restore(make_mesh(8), like=like)
    (record,) = [r for r in caplog.records if r.name.startswith("zeroshard")]
    assert record.name == "zeroshard.checkpointing.metadata"
    assert re.search("has no checksums .* restored without verifying", record.getMessage())
    assert int(state.step) == 2
    with pytest.raises(ValueError, match="no checksums .* cannot be verified"):
        zs.CheckpointManager(copy).verify()


def test_a_damaged_metadata_record_is_refused(two_steps, tmp_path):
    """The record holds state that is not in the arrays (the skipped-step count, the
    loss scale) and the checksums: a changed digit, or bytes that break the JSON."""
    directory, tx, _, like = two_steps
    for name, change in [
        ("digit", lambda text: text.replace('"skipped_steps": 0', '"skipped_steps": 8')),
        ("bytes", lambda text: text[: len(text) // 2] + "\x00\x01" + text[len(text) // 2 + 2 :]),
    ]:
        copy = tmp_path / name
        shutil.copytree(directory, copy)
        record = copy / "2" / "zeroshard" / "metadata"
        text = record.read_text()
        record.write_text(change(text))
        assert record.read_text() != text
        with pytest.raises(zs.CheckpointCorruptedError, match=r"step 2 of .*corrupted"):
            zs.CheckpointManager(copy, tx).restore(make_mesh(8), like=like)
        assert int(zs.CheckpointManager(copy, tx).restore(make_mesh(8), like, step=1).step) == 1


def inspect_verify(directory, *args):
    return subprocess.run(
        [sys.executable, "-m", "zeroshard", "inspect", str(directory), "--verify", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inspect_verify_checks_a_step_on_one_device_without_training_code(two_steps, tmp_path):
    """A fresh process with one CPU device, no model and no optimizer."""
    directory, tx, _, like = two_steps
    ok = inspect_verify(directory)
    assert ok.returncode == 0, ok.stderr
    assert "checksums: zeroshard-sum32-v1" in ok.stdout
    assert re.search(r"verified step 2: all \d+ leaves match", ok.stdout)
    copy = damage(directory, caught_by_checksum(directory, tx, like, tmp_path), tmp_path / "copy")
    bad = inspect_verify(copy)
    assert bad.returncode == 1
    assert re.search(r"step 2 of .*: the checkpoint is corrupted\. The checksum of", bad.stderr)
    assert "Other steps: [1]" in bad.stderr
    assert inspect_verify(copy, "--step", "1").returncode == 0
