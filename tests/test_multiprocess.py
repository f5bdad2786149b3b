"""Two processes x 4 CPU devices (jax.distributed on loopback, gloo) against one x 8.

Each run starts ``examples/multihost.py`` (the multi-host example of docs/multihost.md) in fresh
processes, bounded by a timeout that kills every process of a run that hangs.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from multihost_runs import Run, process_env

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "multihost.py")
NONFINITE_WORKER = os.path.join(os.path.dirname(__file__), "nonfinite_worker.py")
TIMEOUT = 240  # seconds per run, all processes together
SAVE_AT, STEPS = 3, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, name: str, processes: int, *args: str) -> dict:
    """Runs the example on ``processes`` processes (8 devices in all); returns the
    arrays process 0 wrote. Fails the test if any process fails or the run hangs."""
    out = tmp_path / f"{name}.npz"
    common = ["--local-devices", str(8 // processes), "--steps", str(STEPS), *args]
    if processes > 1:
        common += ["--coordinator", f"127.0.0.1:{free_port()}", "--timeout", "30"]
    procs, logs = [], []
    for i in range(processes):
        log = open(tmp_path / f"{name}.{i}.log", "w+")  # noqa: SIM115 (closed below)
        extra = ["--num-processes", str(processes), "--process-id", str(i)]
        extra += ["--out", str(out)] if i == 0 else []
        procs.append(
            subprocess.Popen(
                [sys.executable, EXAMPLE, *common, *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=process_env(processes),
                start_new_session=True,
            )
        )
        logs.append(log)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        os.killpg(procs[i].pid, signal.SIGKILL)
        procs[i].wait()
    report = []
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        tail = [line for line in log.read().splitlines() if "[Gloo]" not in line][-15:]
        log.close()
        report.append(f"process {i}: {'HUNG, killed' if i in hung else f'exit {p.returncode}'}")
        report += tail
    if hung or any(p.returncode for p in procs):
        pytest.fail(f"run {name!r} failed:\n" + "\n".join(report))
    with np.load(out) as f:
        return dict(f)


def assert_same_run(actual: dict, expected: dict, first_step: int = 0) -> None:
    """Same losses and final state, up to the summation order of the collectives."""
    np.testing.assert_allclose(actual["losses"], expected["losses"][first_step:], rtol=1e-6)
    assert set(actual) == set(expected)
    assert actual["skipped"] == expected["skipped"]
    for key in expected:
        if key not in ("losses", "skipped"):
            scale = max(np.max(np.abs(expected[key])), 1e-30)
            np.testing.assert_allclose(actual[key], expected[key], atol=1e-6 * scale, err_msg=key)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process x 8 devices, saving step 3 (the reference trajectory)."""
    tmp = tmp_path_factory.mktemp("single")
    return tmp, launch(tmp, "single", 1, "--ckpt", str(tmp / "ckpt"), "--save-at", str(SAVE_AT))


def test_two_processes_match_one_and_checkpoints_restore_across(single, tmp_path):
    one_dir, one = single
    two = launch(tmp_path, "two", 2, "--ckpt", str(tmp_path / "ckpt"), "--save-at", str(SAVE_AT))
    assert len(two["losses"]) == STEPS
    assert_same_run(two, one)
    # Saved by two processes, resumed by one; and the other way round.
    resumed_one = launch(tmp_path, "resume1", 1, "--ckpt", str(tmp_path / "ckpt"), "--restore")
    assert_same_run(resumed_one, one, first_step=SAVE_AT)
    resumed_two = launch(tmp_path, "resume2", 2, "--ckpt", str(one_dir / "ckpt"), "--restore")
    assert_same_run(resumed_two, one, first_step=SAVE_AT)


def test_hierarchical_across_two_processes(single, tmp_path):
    """State sharded within each process, replicated across the two: plain optax's
    trajectory, and its checkpoint restores on one process with a 1-D mesh."""
    _, one = single
    ckpt = str(tmp_path / "ckpt")
    hsdp = launch(tmp_path, "hsdp", 2, "--mesh", "replica-data", "--ckpt", ckpt, "--save-at", "3")
    assert_same_run(hsdp, one)
    assert_same_run(launch(tmp_path, "resume", 1, "--ckpt", ckpt, "--restore"), one, SAVE_AT)


def test_deterministic_on_two_processes_is_bit_identical_to_one_device(tmp_path):
    """deterministic=16: 2 processes x 4 devices give the bits of 1 process on 1 device
    (and on 8): the losses and the whole logical state, array_equal."""
    fixed = ["--deterministic", "16"]
    two = launch(tmp_path, "two-fixed", 2, *fixed)
    for name, run in (
        ("one device", launch(tmp_path, "one-fixed", 1, *fixed, "--devices", "1")),
        ("eight", launch(tmp_path, "eight-fixed", 1, *fixed)),
    ):
        assert set(two) == set(run)
        for key in run:
            assert np.array_equal(two[key], run[key]), f"{key}: two processes vs {name}"


def test_a_nan_on_one_process_is_skipped_by_both(single, tmp_path):
    """A NaN in the rows of process 1's last device at step 3: both processes skip
    that step (as one process with 8 devices does), then train on identically."""
    nan = ["--nan-at", "3"]
    two = launch(tmp_path, "two-nan", 2, *nan)
    one = launch(tmp_path, "one-nan", 1, *nan)
    assert int(two["skipped"]) == 1
    assert np.isnan(two["losses"][2]) and np.isfinite(two["losses"][3:]).all()
    np.testing.assert_allclose(two["losses"][:2], single[1]["losses"][:2], rtol=1e-6)
    assert_same_run(two, one)  # NaN losses compare equal


def test_an_inf_in_one_device_s_piece_on_the_other_process_is_skipped_by_both(tmp_path):
    """The mean gradient's only non-finite element lies in the piece of a device of one
    process, the bad row on the other's (and the other way round), stages 1 and 3:
    every device of both processes counts the skip and changes nothing
    (``tests/nonfinite_worker.py`` checks each process's own devices)."""
    run = Run(tmp_path, "one-piece", 2, script=NONFINITE_WORKER, timeout=TIMEOUT)
    codes = run.finish()
    assert codes == [0, 0], run.report()
    for i, devices in enumerate(["[0, 1, 2, 3]", "[4, 5, 6, 7]"]):
        for stage in (1, 3):
            line = f"stage {stage}: devices {devices} skipped 2 steps, changed nothing"
            assert line in run.text(i), run.report()


def test_a_missing_peer_fails_the_run_instead_of_hanging():
    """Process 0 of 2 alone: jax.distributed gives up after --timeout, and the process
    exits with an error well inside the harness's limit."""
    args = ["--local-devices", "4", "--num-processes", "2", "--process-id", "0", "--timeout", "5"]
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, EXAMPLE, *args, "--coordinator", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode != 0
    assert time.monotonic() - started < 60
