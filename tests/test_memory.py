"""The memory planner: the ZeRO paper's figures, and the compiler's own numbers."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import layered_loss, layered_params, make_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs


def test_reproduces_the_zero_paper_example():
    """Rajbhandari et al. (2020), figure 1: 7.5B parameters, 64 devices, K = 12."""
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB = 10^9 bytes
    for stage, gb in paper.items():
        est = zs.estimate_memory(7.5e9, 64, stage=stage)
        assert round(est.total / 1e9, 1) == gb, (stage, est)
    assert (
        zs.estimate_memory(7.5e9, 64, stage=0).optimizer_state
        + zs.estimate_memory(7.5e9, 64, stage=0).master
        == 12 * 7.5e9
    )


def test_optimizer_state_bytes_are_measured_from_an_optax_transform():
    for name, tx in [
        ("adam", optax.adam(1e-3)),
        ("sgd", optax.sgd(0.1)),
        ("momentum", optax.sgd(0.1, momentum=0.9)),
    ]:
        by_name = zs.estimate_memory(1e6, 8, optimizer=name)
        by_tx = zs.estimate_memory(1e6, 8, optimizer=tx)
        assert by_name == by_tx, name
    fp32 = zs.estimate_memory(1e6, 8, param_dtype=jnp.float32)
    assert fp32.master == 0  # fp32 params are their own master


@pytest.mark.parametrize("width", [256, 512, 1024])  # the benchmarks/compare.py models
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_arguments_match_the_planner(stage, param_dtype, width, rng):
    """The state a step reads (XLA's argument bytes) is the planner's params +
    optimizer state + master for the stage, within 10%."""
    n, params = 8, layered_params(rng, width=width)
    mesh = make_mesh(n)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, param_dtype=param_dtype, stage=stage)
    loss_fn = functools.partial(layered_loss, stage=stage)
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    batch = {"x": jnp.ones((n, width), param_dtype), "y": jnp.zeros((n, width), param_dtype)}
    compiled = step.lower(state, batch).compile().memory_analysis()
    batch_bytes = 2 * batch["x"].size * batch["x"].dtype.itemsize / n
    est = zs.estimate_memory(params, n, stage=stage, param_dtype=param_dtype, optimizer="adamw")
    planned = est.params + est.optimizer_state + est.master
    assert compiled.argument_size_in_bytes - batch_bytes == pytest.approx(planned, rel=0.10)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_planner_on_a_mesh_shape_matches_the_compiled_arguments(stage, rng):
    """On a 4 data x 2 model mesh (a mapping of axis sizes): the state (and stage 3's
    weights) split over all 8 devices, the batch over "data"; the compiled
    step's argument bytes are the planner's within 10%. (float32: XLA's CPU compiler
    aborts on a bf16 stage-3 step on a mesh with an Auto "model" axis, "Invalid binary
    instruction opcode copy", on jax 0.10.2 and 0.12.0.1 alike.)"""
    width, params = 256, layered_params(rng, width=256)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(functools.partial(layered_loss, stage=stage), tx, mesh, stage=stage)
    batch = {"x": jnp.ones((8, width)), "y": jnp.zeros((8, width))}
    compiled = step.lower(state, batch).compile().memory_analysis()
    batch_bytes = 2 * batch["x"].nbytes / 4
    shape = {"data": 4, "model": 2}
    est = zs.estimate_memory(params, shape, stage=stage, param_dtype=jnp.float32, optimizer=tx)
    planned = est.params + est.optimizer_state + est.master
    assert compiled.argument_size_in_bytes - batch_bytes == pytest.approx(planned, rel=0.10)
    one_axis = zs.estimate_memory(params, 8, stage=stage, param_dtype=jnp.float32, optimizer=tx)
    assert est.optimizer_state == pytest.approx(one_axis.optimizer_state, rel=0.01)
    with pytest.raises(ValueError, match="no axis 'data'"):
        zs.estimate_memory(params, {"fsdp": 8}, optimizer=tx)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_planner_counts_tensor_parallel_weights_as_laid_out(stage, rng):
    """Weights laid out over "model" (each ``w`` column-parallel, each ``b`` split):
    the step keeps that layout, so a device holds half of them. The planner counts
    them so, from the arrays' own shardings or from ``param_specs``, and the step
    that step_memory compiles for those arrays holds what the planner says (within
    10%)."""
    width, params = 256, layered_params(rng, width=256)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {k: {"w": P(None, "model"), "b": P("model")} for k in params}
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    tx, shape = zs.sharded(optax.adamw(1e-3), axis_name="data"), {"data": 4, "model": 2}
    plan = functools.partial(zs.estimate_memory, stage=stage, param_dtype=jnp.float32, optimizer=tx)
    est = plan(placed, shape)
    assert est.params == sum(x.nbytes for x in jax.tree.leaves(params)) / 2
    assert plan(params, shape, param_specs=specs) == est
    assert plan(params, shape).params == 2 * est.params  # (no layout: replicated)
    batch = {"x": jnp.ones((8, width)), "y": jnp.zeros((8, width))}
    loss = functools.partial(layered_loss, stage=stage)
    memory = zs.step_memory(loss, tx, mesh, placed, batch, stage=stage)
    batch_bytes = 2 * batch["x"].nbytes / 4
    planned = est.params + est.optimizer_state + est.master
    assert memory.arguments - batch_bytes == pytest.approx(planned, rel=0.10)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_memory_is_the_compiled_step_of_the_run(stage, rng):
    """The peak planner, on abstract values (nothing allocated), gives the memory of the
    very program the run compiles from real arrays: arguments, outputs, temporaries
    and aliases equal, for bf16 parameters with fp32 masters."""
    n, width, params = 8, 256, layered_params(rng, width=256)
    mesh = make_mesh(n)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data")
    loss_fn = functools.partial(layered_loss, stage=stage)
    batch = {"x": jnp.ones((2 * n, width)), "y": jnp.zeros((2 * n, width))}
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    planned = zs.step_memory(loss_fn, tx, mesh, *structs, stage=stage, param_dtype=jnp.bfloat16)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    stats = step.lower(state, batch).compile().memory_analysis()
    real = (stats.argument_size_in_bytes, stats.output_size_in_bytes)
    real += (stats.temp_size_in_bytes, stats.alias_size_in_bytes)
    assert tuple(planned) == real
    assert planned.peak == real[0] + real[1] + real[2] - real[3] > 0


def test_plan_command_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", "--params", "7.5e9", "--devices", "64"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "| 1 (optimizer state) |" in out and "31.41 GB" in out and "1.88 GB" in out


MODEL_FILE = """
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, muon

import zeroshard as zs


def init_params():
    return {
        "embed": jnp.zeros((1024, 128)),
        "blocks": {"up": jnp.zeros((8, 128, 256)), "down": jnp.zeros((8, 256, 128))},
    }


def make_tx():
    layer = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    dims = {"embed": None, "blocks": {"up": layer, "down": layer}}
    return zs.sharded(muon(1e-2, muon_weight_dimension_numbers=dims), stacked=["blocks"])
"""


def test_plan_command_prints_the_placement_of_a_model(tmp_path):
    """``--params module:function --optimizer module:function``: the stage table of the
    placement zs.sharded chooses, and the placement itself (Muon's stacked matrices
    owned layer by layer, one layer of each per device; the embedding on Adam, sliced)."""
    (tmp_path / "mymodel.py").write_text(MODEL_FILE)
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", "--devices", "8", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = run("--params", "mymodel:init_params", "--optimizer", "mymodel:make_tx").stdout
    assert "leaves: 2 layer-owned, 1 sliced" in out, out
    # bf16 params: each layer's fp32 momentum and fp32 master, 2 x 4 x 128 x 256 B each.
    row = "| ['blocks']['down'][1 layer], ['blocks']['up'][1 layer] | 524,288 |"
    assert all(f"| {d} {row}" in out for d in range(8)), out
    assert "imbalance (max/mean): owned bytes 1.00, update cost 1.00" in out, out
    bad = run("--params", "mymodel:no_such_function", "--optimizer", "adam")
    assert bad.returncode == 1 and "no_such_function" in bad.stderr


PEAK_FILE = """
import jax
import jax.numpy as jnp
import zeroshard as zs


def init_params():
    return {"blocks": {"w": jnp.zeros((8, 256, 256))}, "head": jnp.zeros((256, 16))}


def loss_fn(params, batch):
    layer = zs.layer(lambda p, x: jnp.tanh(x @ p["w"]))
    x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), batch["x"], params["blocks"])
    return jnp.mean((x @ zs.gather(params["head"]) - batch["y"]) ** 2)


def make_batch():
    return {"x": jnp.zeros((32, 256)), "y": jnp.zeros((32, 16))}


def make_tx():
    import optax
    return zs.sharded(optax.adam(1e-3), stacked=["blocks"])
"""


def test_plan_command_on_a_mesh_shape():
    """``--mesh data=4,model=2``: the table of zs.estimate_memory on that mesh shape
    (stages 1-2's state over all 8 devices), and a clear error for a bad shape."""
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", "--params", "7.5e9", *a],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run("--mesh", "data=4,model=2")
    assert out.returncode == 0, out.stderr
    for stage in range(4):
        total = zs.estimate_memory(7.5e9, {"data": 4, "model": 2}, stage=stage).total
        assert f"{total / 1e9:.2f} GB |" in out.stdout.splitlines()[4 + stage]
    bad = run("--mesh", "data=four")
    assert bad.returncode == 2 and "expected axis=size" in bad.stderr


SPECS_FILE = """
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def init_params():  # (traced with jax.eval_shape: nothing allocated)
    return {"up": jnp.zeros((8192, 32768)), "down": jnp.zeros((32768, 8192))}


def specs():
    return {"up": P(None, "model"), "down": P("model", None)}


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["up"]) @ params["down"] - batch["x"]) ** 2)


def make_batch():
    return {"x": jnp.zeros((16, 8192))}


def make_tx():
    import optax
    import zeroshard as zs
    return zs.sharded(optax.adam(1e-3))
"""


PEAK_ARGS = ("--loss", "tpmodel:loss_fn", "--batch", "tpmodel:make_batch")


def test_plan_command_with_the_params_specs(tmp_path):
    """``--param-specs``: the weights counted as laid out over "model" (half of each
    per device below stage 3, as zs.estimate_memory's param_specs= says), and the
    compiled peaks of the steps that keep that layout; refused without --mesh."""
    (tmp_path / "tpmodel.py").write_text(SPECS_FILE)
    args = ["--params", "tpmodel:init_params", "--param-dtype", "float32"]
    args += ["--optimizer", "tpmodel:make_tx"]
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", *args, *a],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = run("--mesh", "data=4,model=2", "--param-specs", "tpmodel:specs")
    assert out.returncode == 0, out.stderr
    f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    params = {"up": f(8192, 32768), "down": f(32768, 8192)}
    specs = {"up": P(None, "model"), "down": P("model", None)}
    plan = functools.partial(zs.estimate_memory, params, {"data": 4, "model": 2})
    for stage in range(4):
        est = plan(stage=stage, param_dtype=jnp.float32, param_specs=specs)
        row = out.stdout.splitlines()[4 + stage].split("|")
        assert row[2].strip() == f"{est.params / 1e9:.2f} GB"
        assert row[6].strip() == f"{est.total / 1e9:.2f} GB"
    assert (
        plan(stage=1, param_dtype=jnp.float32, param_specs=specs).params == 2**31 / 2
    )  # (fp32, 2**29 parameters: half per device)
    peaks = run("--mesh", "data=4,model=2", "--param-specs", "tpmodel:specs", *PEAK_ARGS)
    assert peaks.returncode == 0, peaks.stderr
    (stage1,) = [line for line in peaks.stdout.splitlines() if line.startswith("| 1 | ")]
    # Stage 1 compiled with the weights half per device (2**30 B; replicated: 2**31) and
    # Adam's two fp32 moments 1/8 each (2**29 B), with the batch and a few scalars.
    arguments = int(stage1.split("|")[2].replace(",", ""))
    assert arguments == pytest.approx(2**30 + 2**29, rel=0.001), peaks.stdout
    bad = run("--devices", "8", "--param-specs", "tpmodel:specs")
    assert bad.returncode == 2 and "--param-specs goes with --mesh" in bad.stderr


def test_plan_command_prints_each_stage_s_compiled_peak(tmp_path):
    """``--loss``/``--batch``: the compiled peak per stage on ``--devices`` simulated
    devices, the same as zs.step_memory's; stage 3's is the smallest."""
    (tmp_path / "peakmodel.py").write_text(PEAK_FILE)
    args = ["--params", "peakmodel:init_params", "--optimizer", "peakmodel:make_tx"]
    args += ["--loss", "peakmodel:loss_fn", "--batch", "peakmodel:make_batch"]
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", "--devices", "4", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "," in line]
    peaks = {int(r.split("|")[1]): int(r.split("|")[4].replace(",", "")) for r in rows[-3:]}
    assert sorted(peaks) == [1, 2, 3] and peaks[3] < peaks[1], out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", "--devices", "4", *args[:6]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "--loss and --batch go together" in bad.stderr
