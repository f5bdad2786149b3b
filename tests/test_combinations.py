"""Every combination trains like plain optax, or is refused clearly by zeroshard.

A seeded sampler draws a mesh and its axis types, an entry (the one-line drop-in in
the user's ``jax.jit``, or ``make_train_step`` at a stage, with or without
accumulation), an optimizer (with or without ``optax.clip_by_global_norm``), an
option (quantized collectives, low-bit state, ``deterministic=``) and an extra
(stacked layers, loss scaling, bf16 parameters, a checkpoint restored on another
mesh). Each draw must either train like plain optax on one device on the global
batch, with the state spread over the devices, or be refused by zeroshard itself: a
``ValueError`` or ``TypeError`` raised from zeroshard's code while it traces (before
anything compiles), whose message is one of the refusals ``docs/combinations.md``
lists. An error from inside jax, optax or flax, a wrong number, or fat state fails.
The default tier runs the first 8 draws, the slow tier the other 192 (conftest.py).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import reference_run
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import zeroshard as zs

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "combinations.md"
DRAWS = 200

# name: (shape, axis names, the optimizer's axis keywords, the batch axes)
MESHES = {
    "8": ((8,), ("data",), {}, ("data",)),
    "4data_2model": ((4, 2), ("data", "model"), {}, ("data",)),
    "2replica_2data_2model": (
        (2, 2, 2),
        ("replica", "data", "model"),
        {"replica_axis": "replica"},
        ("replica", "data"),
    ),
    "2data_4fsdp": ((2, 4), ("data", "fsdp"), {"axis_name": ("data", "fsdp")}, ("data", "fsdp")),
}
# A restored checkpoint goes to the first four devices, the same axes.
HALF = {
    "8": (4,),
    "4data_2model": (2, 2),
    "2replica_2data_2model": (1, 2, 2),
    "2data_4fsdp": (2, 2),
}
LION_LR = 1e-3
SIGN_BASED = {"lion"}
SIGN_FLIPS = 0.002  # (of a leaf's elements: a sign flipped where a direction is ~0)
OPTIMIZERS = {  # (Adam's eps above its gradients' rounding: pitfall of cancellation)
    "adamw": lambda: optax.adamw(1e-2, eps=1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "lion": lambda: optax.lion(LION_LR),
    "adafactor": lambda: optax.adafactor(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "lamb": lambda: optax.lamb(1e-2, eps=1e-3),
}
WHOLE_TENSOR = {"adafactor", "muon"}  # at real sizes: both dims >= 128 (factored)
OPTIONS = {
    "none": {},
    "int8_grads": {"quantize_grads": "int8"},
    "int8_grads_weights": {"quantize_grads": "int8", "quantize_weights": "int8"},
    "state_bits_8": {"state_bits": 8},
    "state_bits_4": {"state_bits": 4},
    "deterministic_16": {"deterministic": 16},
}
# Coded options' error after two steps, ||got - optax|| / ||optax - start|| (the weights'
# own rounding allowed for): low-bit state's update error is 5.5% (8 bits) and 48-52%
# (4 bits) per step (docs/lowbit.md); int8 codes round each gradient by at most half a
# code step, 1/254 of its block's largest magnitude (docs/quantized.md), which Adam, Lion
# and Muon amplify where a gradient is near zero. docs/combinations.md states these.
CODED_BOUND = {"int8_grads": 0.10, "int8_grads_weights": 0.10, "state_bits_8": 0.10}
CODED_BOUND["state_bits_4"] = 0.75
ENTRIES = ["dropin", "stage1", "stage1_accum2", "stage2", "stage2_accum2", "stage3"]
ENTRIES.append("stage3_accum2")
EXTRAS = ["none", "stacked", "loss_scale", "bf16_params", "restore"]


@dataclasses.dataclass(frozen=True)
class Draw:
    mesh: str
    auto: bool
    entry: str
    optimizer: str
    clip: bool
    option: str
    extra: str

    @property
    def stage(self) -> int:
        return 0 if self.entry == "dropin" else int(self.entry[5])

    @property
    def accum_steps(self) -> int:
        return 2 if self.entry.endswith("accum2") else 1


def draw(seed: int) -> Draw:
    """Draw ``seed`` of the sampler (numpy's generator, seeded: the same on every run)."""
    rng = np.random.default_rng([54, seed])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]
    entry = pick(ENTRIES)
    extras = EXTRAS if entry != "dropin" else EXTRAS[:-1]  # (a checkpoint: the step's)
    return Draw(
        pick(list(MESHES)),
        bool(rng.integers(2)),
        entry,
        pick(list(OPTIMIZERS)),
        bool(rng.integers(2)),
        pick(list(OPTIONS)),
        pick(extras),
    )


def model(d: Draw) -> tuple[dict, list[dict]]:
    """A column- then row-parallel MLP (and a scanned stack of layers), and 2 batches."""
    rng = np.random.default_rng(0)
    width, hidden = (128, 128) if d.optimizer in WHOLE_TENSOR else (32, 128)
    f = lambda *s: jnp.asarray(
        rng.normal(size=s) / np.sqrt(s[-2] if len(s) > 1 else 4), jnp.float32
    )
    params = {"up": f(width, hidden), "down": f(hidden, width), "b": f(width)}
    if d.extra == "stacked":
        params["blocks"] = f(2, width, width)
    if d.extra == "bf16_params":
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    batch = lambda: {k: jnp.asarray(rng.normal(size=(256, width)), jnp.float32) for k in "xy"}
    return params, [batch(), batch()]


def loss_fn(params: dict, batch: dict) -> jax.Array:
    """The MLP as written for its mesh: on an Explicit "model" axis, its weights resharded
    for tensor parallelism (as flax's and MaxText's models write it); plain elsewhere."""
    p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    x, mesh = batch["x"], jax.sharding.get_abstract_mesh()
    if "blocks" in p:  # (scan over layers)
        x = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["blocks"])[0]
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True)) if not mesh.empty else {}
    if types.get("model") == AxisType.Explicit:
        up, down = reshard(p["up"], P(None, "model")), reshard(p["down"], P("model", None))
        rows = tuple(a for a in ("replica", "data") if types.get(a) == AxisType.Explicit)
        out = jnp.dot(jnp.tanh(x @ up), down, out_sharding=P(rows or None, None))
    else:
        out = jnp.tanh(x @ p["up"]) @ p["down"]
    return jnp.mean((out + p["b"] - batch["y"]) ** 2)


def make_mesh(d: Draw, shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
    shape, names = shape or MESHES[d.mesh][0], MESHES[d.mesh][1]
    types = {"axis_types": (AxisType.Auto,) * len(names)} if d.auto else {}
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, devices=jax.devices()[:n], **types)


def placed(params: dict, mesh: jax.sharding.Mesh) -> dict:
    """``params`` column/row-parallel over "model" where the mesh has it, else replicated."""
    tp = "model" in mesh.axis_names
    specs = {"up": P(None, "model"), "down": P("model", None)} if tp else {}
    return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in params.items()}


def optimizer(d: Draw) -> tuple[optax.GradientTransformation, dict]:
    inner = OPTIMIZERS[d.optimizer]()
    if d.clip:
        inner = optax.chain(optax.clip_by_global_norm(0.5), inner)
    options = {**MESHES[d.mesh][2], **OPTIONS[d.option]}
    if d.extra == "stacked":
        options["stacked"] = ["blocks"]
    if d.extra == "loss_scale":
        options["loss_scale"] = zs.DynamicLossScale(initial=2.0**10)
    return inner, options


def run_dropin(d: Draw, tx, params: dict, data: list[dict]) -> tuple[dict, object]:
    """The user's own jitted step, plain optax's API (the loss scaled by hand)."""
    mesh = make_mesh(d)
    rows = NamedSharding(mesh, P(MESHES[d.mesh][3]))
    with jax.set_mesh(mesh):
        params = placed(params, mesh)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            scale = opt_state.loss_scale.scale if d.extra == "loss_scale" else 1.0
            grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        for batch in data:
            params, opt_state = step(params, opt_state, jax.device_put(batch, rows))
    return params, opt_state


def run_step(d: Draw, tx, params: dict, data: list[dict], tmp_path) -> tuple[dict, object]:
    """``make_train_step`` at the draw's stage; with ``restore``, the second step on
    another mesh (half the devices) from a checkpoint of the first."""
    stage, loss = d.stage, loss_fn
    if stage == 3:
        loss = lambda p, b: loss_fn(zs.gather(p), b)
    mesh = make_mesh(d)
    state = zs.init_train_state(placed(params, mesh), tx, mesh, stage=stage)
    for i, batch in enumerate(data):
        if d.extra == "restore" and i == 1:
            ckpt = zs.CheckpointManager(tmp_path / "ckpt", tx)
            ckpt.save(state)
            ckpt.wait_until_finished()
            mesh = make_mesh(d, HALF[d.mesh])
            state = ckpt.restore(mesh, like=placed(params, mesh), stage=stage)
            ckpt.close()
        step = zs.make_train_step(loss, tx, mesh, stage=stage, accum_steps=d.accum_steps)
        state, _ = step(state, batch)
    return (state.params if stage < 3 else zs.to_optax_state(state, tx)[0]), state.opt_state


def check_numbers(d: Draw, got: dict, params: dict, data: list[dict], inner) -> float:
    """Plain optax on one device on the global batch, after each leaf's rounding is
    allowed for (bf16 parameters: 2^-8 of the value; int8 weights: half a code step,
    1/254 of the leaf's largest magnitude): for exact options, each leaf within 1e-5
    of its displacement, in L2 (bf16 parameters: 2^-7, the gradients' bf16 rounding);
    for coded options, the whole tree within :data:`CODED_BOUND` of its displacement.
    Returns the error."""
    bf16 = d.extra == "bf16_params"
    expected = reference_run(loss_fn, inner, params, data, jnp.bfloat16 if bf16 else None)
    leaves = lambda t: [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)]
    got, expected, start = leaves(got), leaves(expected), leaves(params)
    moved = [e - s for e, s in zip(expected, start, strict=True)]
    assert all(np.max(np.abs(m)) > 0 for m in moved)
    coded = {"int8_grads": d.entry != "dropin"}.get(d.option, d.option in CODED_BOUND)
    codes = "weights" in d.option

    def off(a, e):  # what rounding the weights, as they travel or are kept, does not explain
        rounding = (2**-8 * np.abs(e) if bf16 else 0) + (np.max(np.abs(e)) / 254 if codes else 0)
        return np.maximum(np.abs(a - e) - rounding, 0)

    if coded:
        residual = np.concatenate([off(a, e) for a, e in zip(got, expected, strict=True)])
        error = np.linalg.norm(residual) / np.linalg.norm(np.concatenate(moved))
        assert error <= CODED_BOUND[d.option], error
        return error
    if bf16 and d.optimizer in SIGN_BASED:
        return check_signs(d, got, params, data, inner)
    bound = 2**-7 if bf16 else 1e-5
    errors = [
        np.linalg.norm(off(a, e)) / np.linalg.norm(m)
        for a, e, m in zip(got, expected, moved, strict=True)
    ]
    assert max(errors) <= bound, errors
    return max(errors)


def check_signs(d: Draw, got: list, params: dict, data: list[dict], inner) -> float:
    """A sign-based update (Lion) on bf16 gradients, against plain optax on the mean of
    the same data-parallel parts' bf16 gradients (:func:`helpers.reference_run`): each
    element moves by +-lr a step, so where a direction is within the gradients' rounding
    of zero, summing the parts in another order flips its sign and the element lands
    2 lr per step away. At most :data:`SIGN_FLIPS` of a leaf's elements may do so, none
    by more; every other element is the reference's up to the weights' bf16 rounding.
    Returns the share of flipped elements."""
    shape, names, _, rows = MESHES[d.mesh]
    sizes = [n for n, a in zip(shape, names, strict=True) if a in rows]
    parts = d.accum_steps * int(np.prod(sizes))
    expected = reference_run(loss_fn, inner, params, data, jnp.bfloat16, num_devices=parts)
    worst = 0.0
    for a, e in zip(got, jax.tree.leaves(expected), strict=True):
        e = np.asarray(e, np.float64).ravel()
        off = np.maximum(np.abs(a - e) - 2**-8 * np.abs(e), 0)
        flipped = off > 0
        assert np.max(off, initial=0) <= 2 * LION_LR * len(data), np.max(off)
        assert flipped.mean() <= SIGN_FLIPS, (int(flipped.sum()), flipped.size)
        worst = max(worst, float(flipped.mean()))
    return worst


def check_state_bytes(d: Draw, opt_state, params: dict, inner) -> None:
    """The fullest device holds at most 1.10x its share of the state: of its total over
    the devices it is split over (all but the replicas), its scalars (step counts,
    the loss scale) on every device. An elementwise optimizer's total is the state's
    own; a whole-tensor optimizer's is plain optax's (and the fp32 master, where one is
    kept), so an owner's padded row shows, and its owned units add at most the
    largest of them (their granularity: docs/optimizers.md)."""
    held: dict = {}
    total = scalars = 0
    for leaf in jax.tree.leaves(opt_state):
        if leaf.size <= 1:
            scalars += leaf.nbytes
            continue
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    replicas = 2 if d.mesh.startswith("2replica") else 1
    devices, unit = len(held) // replicas, 0
    if d.optimizer in WHOLE_TENSOR:
        f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        nbytes = lambda tree: sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.size > 1
        )
        master = d.extra == "bf16_params" or "weights" in d.option
        total = nbytes(inner.init(f32)) + (nbytes(f32) if master else 0)
        leaf = lambda x: nbytes(jax.eval_shape(inner.init, {"x": x})) + (nbytes(x) if master else 0)
        unit = max(map(leaf, f32.values()))  # (an owned leaf's state, and its master)
    fullest = max(held.values())
    assert fullest <= 1.10 * total / devices + unit + scalars, (fullest, total / devices, unit)


def refusals() -> list[str]:
    """The refusals docs/combinations.md lists: the start of each message, in backticks."""
    table = DOC.read_text().split("| refusal ", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\| `([^`]+)`", table, re.MULTILINE)


def check_refusal(d: Draw, error: Exception) -> str:
    """A refusal by zeroshard itself, at trace time, one the docs list."""
    frames = traceback.extract_tb(error.__traceback__)
    raised_in = pathlib.Path(frames[-1].filename)
    assert isinstance(error, ValueError | TypeError), error
    assert "zeroshard" in raised_in.parts and "site-packages" not in raised_in.parts, (
        f"{d}: an error from outside zeroshard ({raised_in}): {error!r}"
    )
    message = " ".join(str(error).split())
    listed = [r for r in refusals() if r in message]
    assert listed, f"{d}: a refusal docs/combinations.md does not list: {message}"
    return listed[0]


def run_value_and_grad(d: Draw, tx, params: dict, data: list[dict]) -> tuple[dict, object]:
    """The user's own jitted step with zeroshard's gradient, ``tx.value_and_grad``, at
    the draw's stage (3: the weights laid out by ``tx.shard_params``, read through
    ``zs.gather``; the loss scaled by hand)."""
    mesh, tx = make_mesh(d), tx.at_stage(d.stage)
    rows = NamedSharding(mesh, P(MESHES[d.mesh][3]))
    read = zs.gather if d.stage == 3 else lambda p: p
    with jax.set_mesh(mesh):
        params = placed(params, mesh)
        params = tx.shard_params(params) if d.stage == 3 else params
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            scale = opt_state.loss_scale.scale if d.extra == "loss_scale" else 1.0
            loss = lambda p, b, scale: loss_fn(read(p), b) * scale  # (scaled by hand)
            grad = tx.value_and_grad(loss, accum_steps=d.accum_steps, layout=opt_state.layout)
            updates, opt_state = tx.update(grad(params, batch, scale=scale)[1], opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        for batch in data:
            params, opt_state = step(params, opt_state, jax.device_put(batch, rows))
        got = jax.device_get(zs.gather(params, tx.axis_name)) if d.stage == 3 else params
    return got, opt_state


def run_draw(d: Draw, tmp_path) -> str:
    """Runs draw ``d``; returns "works" or the refusal met."""
    params, data = model(d)
    inner, options = optimizer(d)
    try:
        tx = zs.sharded(inner, **options)
        vg = "_vg" in d.entry  # (tx.value_and_grad in the user's jit)
        run = run_dropin if d.entry == "dropin" else run_value_and_grad if vg else run_step
        args = (tmp_path,) if run is run_step else ()
        got, opt_state = run(d, tx, params, data, *args)
    except (ValueError, TypeError) as error:
        return check_refusal(d, error)
    error = check_numbers(d, got, params, data, inner)
    check_state_bytes(d, opt_state, params, inner)
    return f"works ({error:.1e})"


@pytest.mark.parametrize("seed", range(DRAWS), ids=lambda s: f"draw{s:03d}")
def test_every_combination_trains_like_optax_or_is_refused(seed, tmp_path):
    d = draw(seed)
    print(f"{seed:03d} {d}: {run_draw(d, tmp_path)}")


VG_ENTRIES = ["stage1_vg", "stage1_vg_accum2", "stage2_vg", "stage2_vg_accum2", "stage3_vg"]
VG_ENTRIES.append("stage3_vg_accum2")


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"draw{s:03d}")
def test_every_combination_through_value_and_grad(seed, tmp_path):
    """The sampler's draws with the entry ``tx.value_and_grad`` in the user's own
    ``jax.jit`` (stages 1-3, with and without accumulation; no checkpoint): plain
    optax's numbers, or a refusal the docs list. The default tier runs the first 8, the
    slow tier the other 4."""
    d = draw(1000 + seed)
    rng = np.random.default_rng([55, seed])
    extra = "none" if d.extra == "restore" else d.extra
    d = dataclasses.replace(d, entry=VG_ENTRIES[int(rng.integers(len(VG_ENTRIES)))], extra=extra)
    print(f"{seed:03d} {d}: {run_draw(d, tmp_path)}")


def test_each_refusal_the_table_lists_is_raised_and_no_other_is_listed(tmp_path):
    """The refusals of docs/combinations.md, each met by the smallest program that
    meets it (tracing, never compiling); the table lists no others."""
    params = {"w": jnp.ones((16, 8))}
    mesh = jax.make_mesh((8,), ("data",))
    exact = zs.sharded(optax.sgd(0.1), deterministic=16)

    def dropin():
        with jax.set_mesh(mesh):
            jax.eval_shape(exact.update, params, exact.init(params), params)

    def model_first():
        three = zs.sharded(optax.sgd(0.1), stage=3)
        with jax.set_mesh(jax.make_mesh((2, 4), ("model", "data"))):
            three.shard_params(params)

    cases = [
        lambda: zs.sharded(optax.sgd(0.1), deterministic=16, quantize_grads="int8"),
        dropin,
        lambda: zs.make_train_step(lambda p, b: 0.0, exact, mesh, accum_steps=2),
        model_first,
    ]
    met = []
    for case in cases:
        with pytest.raises(ValueError) as refused:
            case()
        met.append(check_refusal(draw(0), refused.value))
    # A global norm over a Muon leaf owned whole, stage 3 (the smallest draw found).
    met.insert(2, run_draw(draw(62), tmp_path))
    assert met == refusals()


# The draws that failed inside jax before they were fixed (each on its own below).
REGRESSIONS = {
    # An accumulator's zeros built from their shape's manual axis type (Auto axes: jax
    # asserted) or without its sharding (Explicit axes: scan's carry types differed).
    "accum_on_auto_4x2": Draw(
        "4data_2model", True, "stage1_accum2", "adamw", False, "none", "none"
    ),
    "accum_on_auto_2x2x2": Draw(
        "2replica_2data_2model", True, "stage3_accum2", "lion", True, "none", "none"
    ),
    "accum_on_explicit_2x2x2_int8": Draw(
        "2replica_2data_2model",
        False,
        "stage2_accum2",
        "adafactor",
        False,
        "int8_grads_weights",
        "none",
    ),
    # The blocked update traced on a state shaped under jax.set_mesh of an Explicit mesh.
    "dropin_muon_explicit": Draw("8", False, "dropin", "muon", False, "none", "none"),
    "dropin_adafactor_explicit": Draw("8", False, "dropin", "adafactor", False, "none", "none"),
    # A step that planned again inside its trace, on its layout's splits.
    "muon_stage1_explicit_tp": Draw("4data_2model", False, "stage1", "muon", False, "none", "none"),
    "muon_stage3_explicit_tp": Draw(
        "4data_2model", False, "stage3_accum2", "muon", False, "none", "none"
    ),
}


@pytest.mark.parametrize("name", REGRESSIONS)
def test_combinations_that_failed_inside_jax_train_like_optax(name, tmp_path):
    assert run_draw(REGRESSIONS[name], tmp_path).startswith("works")
