"""Alike leaves updated as one buffer: the same bits as leaf by leaf, fewer updates.

On more than one device, sliced leaves whose update is the same elementwise
computation share one buffer (``group_alike``, on by default). These tests check that
this changes no bit of the weights or of the state (against the same run leaf by
leaf, and against plain optax on one device), that a checkpoint's logical state moves
between the two layouts, that hyperparameters, masks and labels keep leaves apart,
and that the compiled step runs the update once per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, make_mesh, reference_run
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
from zeroshard.core.placement import RUNTIME_OFFSETS

LAYERS, WIDTH, N = 6, 16, 8


def layers_params(rng: np.random.Generator, layers: int = LAYERS) -> dict:
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
    return {f"l{k}": {"w": f(WIDTH, WIDTH), "b": f(WIDTH)} for k in range(layers)}


def layers_loss(params: dict, batch: dict, stage: int = 1) -> jax.Array:
    p = zs.gather(params) if stage == 3 else params
    h = batch["x"]
    for k in range(len(params)):
        h = jnp.tanh(h @ p[f"l{k}"]["w"] + p[f"l{k}"]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def layers_batches(rng: np.random.Generator, steps: int) -> list[dict]:
    f = lambda: jnp.asarray(rng.normal(size=(16, WIDTH)), jnp.float32)
    return [{"x": f(), "y": f()} for _ in range(steps)]


def train(tx, params, data, stage, state=None):
    mesh = make_mesh(N)
    state = state or zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(lambda p, b: layers_loss(p, b, stage), tx, mesh, stage=stage)
    for batch in data:
        state, _ = step(state, batch)
    return state


INNERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1)}


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", sorted(INNERS))
def test_alike_leaves_in_one_buffer_give_the_same_bits(name, stage, rng):
    params, data = layers_params(rng), layers_batches(rng, 4)
    grouped = zs.sharded(INNERS[name](), axis_name="data")
    apart = zs.sharded(INNERS[name](), axis_name="data", group_alike=False)
    # Two groups: the weights and the biases (pieces of another shape).
    assert [len(g) for g in grouped.plan(params, N).groups] == [LAYERS, LAYERS]
    assert apart.plan(params, N).groups == ()
    a, b = train(grouped, params, data[:3], stage), train(apart, params, data[:3], stage)
    # The weights (fp32: their own master) and the optimizer state, per leaf.
    logical_a, logical_b = zs.to_optax_state(a, grouped), zs.to_optax_state(b, apart)
    jax.tree.map(np.testing.assert_array_equal, logical_a, logical_b)
    expected = reference_run(layers_loss, INNERS[name](), params, data[:3])
    assert_trees_close(logical_a[0], expected, 1e-5)
    # The logical state (what a checkpoint holds) restores into the other layout and
    # continues bit for bit.
    mesh = make_mesh(N)
    moved = zs.from_optax_state(*logical_b, grouped, mesh, step=3, stage=stage)
    a, b = train(grouped, params, data[3:], stage, moved), train(apart, params, data[3:], stage, b)
    after_a, after_b = zs.to_optax_state(a, grouped), zs.to_optax_state(b, apart)
    jax.tree.map(np.testing.assert_array_equal, after_a, after_b)


def test_a_global_norm_spans_the_groups_buffers(rng):
    """Clipping by the global norm: the leaves are grouped (the norm's sum runs over the
    groups' buffers, padding left out), and the result is plain optax's. The sum is
    taken in another order than leaf by leaf, so the clipping factor may differ in its
    last bits: the two layouts agree to float32 rounding, not bit for bit."""
    params, data = layers_params(rng), layers_batches(rng, 3)
    inner = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
    grouped = zs.sharded(inner(), axis_name="data")
    apart = zs.sharded(inner(), axis_name="data", group_alike=False)
    assert [len(g) for g in grouped.plan(params, N).groups] == [LAYERS, LAYERS]
    a, b = train(grouped, params, data, 1), train(apart, params, data, 1)
    logical_a, logical_b = zs.to_optax_state(a, grouped), zs.to_optax_state(b, apart)
    assert_trees_close(logical_a, logical_b, 1e-6)
    expected = reference_run(layers_loss, inner(), params, data)
    assert_trees_close(logical_a[0], expected, 1e-5)
    unclipped = reference_run(layers_loss, optax.adamw(1e-2), params, data)
    assert not np.allclose(unclipped["l0"]["w"], expected["l0"]["w"], atol=1e-4)  # it clipped


def test_grouped_leaves_beside_leaves_with_norms_of_their_own(rng):
    """Adam's leaves grouped, LAMB's (a trust ratio per leaf) each on its own: the
    update runs with the sums made whole, on a tree without the grouped leaves' holes."""
    params, data = layers_params(rng), layers_batches(rng, 3)
    labels = {k: {"w": "lamb" if k in ("l0", "l1") else "adam", "b": "adam"} for k in params}
    inner = lambda: optax.multi_transform(
        {"lamb": optax.lamb(1e-2), "adam": optax.adam(1e-2)}, labels
    )
    tx = zs.sharded(inner(), axis_name="data")
    plan = tx.plan(params, N)
    assert plan.holes and [len(g) for g in plan.groups] == [LAYERS, LAYERS - 2]
    state = train(tx, params, data, 1)
    expected = reference_run(layers_loss, inner(), params, data)
    assert_trees_close(zs.to_optax_state(state, tx)[0], expected, 1e-5)


def test_hyperparameters_masks_and_labels_keep_leaves_apart(rng):
    params = {f"m{k}": jnp.zeros((WIDTH, WIDTH)) for k in range(6)}
    groups = lambda inner: zs.sharded(inner, axis_name="data").plan(params, N).groups
    assert groups(optax.adam(1e-2)) == ((0, 1, 2, 3, 4, 5),)
    labels = {f"m{k}": "fast" if k < 2 else "slow" for k in range(6)}
    by_label = optax.multi_transform({"fast": optax.adam(1e-2), "slow": optax.adam(1e-3)}, labels)
    assert groups(by_label) == ((0, 1), (2, 3, 4, 5))
    same_rate = optax.multi_transform({"fast": optax.adam(1e-2), "slow": optax.adam(1e-2)}, labels)
    assert groups(same_rate) == ((0, 1), (2, 3, 4, 5))  # each label has its own step count
    mask = {f"m{k}": k % 3 == 0 for k in range(6)}
    assert groups(optax.adamw(1e-2, mask=mask)) == ((0, 3), (1, 2, 4, 5))
    assert groups(optax.lamb(1e-2)) == ()  # a norm per leaf: each leaf its own update


def count(text: str, op: str) -> int:
    return text.count(f"stablehlo.{op} ")


def test_the_compiled_step_updates_once_per_group(rng):
    params, batch = layers_params(rng), layers_batches(rng, 1)[0]
    mesh = make_mesh(N)
    sqrts = {}
    for group in (True, False):
        tx = zs.sharded(optax.adam(1e-2), axis_name="data", group_alike=group)
        state = zs.init_train_state(params, tx, mesh)
        step = zs.make_train_step(layers_loss, tx, mesh)
        sqrts[group] = count(step.lower(state, batch).as_text(), "sqrt")
    # Adam takes one square root per leaf (per group), the gradient norm one.
    assert sqrts == {True: 2 + 1, False: 2 * LAYERS + 1}


def packed_gather_operands(jaxpr) -> list[int]:
    """Per all-gather of ``jaxpr`` (nested ones too), the operands of the
    concatenation that packs its input (1 where none does)."""
    out, made = [], {}
    moves = ("reshape", "broadcast_in_dim", "convert_element_type", "bitcast_convert_type")
    for eqn in jaxpr.eqns:
        made.update((id(v), eqn) for v in eqn.outvars)
        if eqn.primitive.name.startswith("all_gather"):  # (_invariant, on jax 0.12)
            x = eqn.invars[0]
            while id(x) in made and made[id(x)].primitive.name in moves:
                x = made[id(x)].invars[0]
            packed = id(x) in made and made[id(x)].primitive.name == "concatenate"
            out.append(len(made[id(x)].invars) if packed else 1)
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += packed_gather_operands(sub)
    return out


def test_a_group_goes_into_the_all_gather_as_one_buffer(rng):
    # The packed all-gather takes each group's new pieces as they are, not cut leaf by
    # leaf first: a slice per leaf is a kernel of its own in the compiled step (at 512
    # leaves, 252 of them that XLA's CPU backend compiled one by one).
    params, batch = layers_params(rng), layers_batches(rng, 1)[0]
    mesh = make_mesh(N)
    tx = zs.sharded(optax.adam(1e-2), axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(layers_loss, tx, mesh)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    jaxpr = step.jitted.trace(state, batch, None).jaxpr
    assert packed_gather_operands(jaxpr.jaxpr) == [2]  # the weights' group, the biases'


def compiled_files(lowered, dump, **options) -> list[str]:
    """The names of the files XLA writes to ``dump`` as it compiles ``lowered`` (not
    read back from the persistent compilation cache: never put there)."""
    key = "jax_persistent_cache_min_compile_time_secs"
    was = getattr(jax.config, key)
    jax.config.update(key, 1e9)
    try:
        lowered.compile(compiler_options={"xla_dump_to": str(dump), **options})
    finally:
        jax.config.update(key, was)
    return [f.name for f in dump.iterdir()]


def lowered_step(rng, layers: int, inner=None, stage: int = 3):
    """zeroshard's step of ``layers`` dense layers (Adam at stage 3 by default), lowered."""
    dense = zs.layer(lambda p, h: jnp.tanh(h @ p["w"] + p["b"]))

    def loss(params, batch):
        h = batch["x"]
        for k in range(len(params)):
            h = dense(params[f"l{k}"], h)
        return jnp.mean((h - batch["y"]) ** 2)

    params, batch = layers_params(rng, layers), layers_batches(rng, 1)[0]
    tx, mesh = zs.sharded(inner or optax.adam(1e-2), axis_name="data"), make_mesh(N)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    return zs.make_train_step(loss, tx, mesh, stage=stage).lower(state, batch)


@pytest.mark.skipif(not RUNTIME_OFFSETS, reason="jax 0.10 builds each slice's offset in")
def test_a_group_is_cut_into_its_leaves_by_one_kernel(rng, tmp_path):
    # XLA's CPU backend compiles a slice at each static offset as a kernel of its own:
    # cut so, a stage-3 step's kernels grew with its alike leaves (47 at 6 layers, 57
    # at 12; 550 at 512 leaves). Cut at offsets given at run time, they do not.
    kernels = {}
    for layers in (LAYERS, 2 * LAYERS):
        files = compiled_files(lowered_step(rng, layers), tmp_path / str(layers))
        kernels[layers] = sum(".obj-file." in f for f in files)
    assert 0 < kernels[2 * LAYERS] <= kernels[LAYERS], kernels


@pytest.mark.parametrize("inner, stage", [("adam", 3), ("lamb", 1)])
def test_the_compiler_simplifies_the_step_in_rounds_that_do_not_grow_with_the_leaves(
    inner, stage, rng, tmp_path
):
    # XLA repeats its simplification passes until none changes the program, 25 rounds
    # at most. The global norm adds the leaves' sums of squares in leaf order; with
    # each sum made one shape by a reshape (Adam's grouped leaves' scalars, LAMB's
    # ungrouped ones vectors of one element), its reshape mover moved one reshape
    # down the chain per round (at 512 leaves: 25 rounds, 10.9 s of XLA's passes, not
    # 4.9). XLA writes the program after each round where that pass changed it.
    rounds = {}
    for layers in (LAYERS, 2 * LAYERS):
        lowered = lowered_step(rng, layers, getattr(optax, inner)(1e-2), stage)
        options = {"xla_dump_hlo_pass_re": "reshape-mover"}
        files = compiled_files(lowered, tmp_path / str(layers), **options)
        rounds[layers] = sum(".simplification.after_reshape-mover." in f for f in files)
    assert rounds[2 * LAYERS] <= rounds[LAYERS] < LAYERS, rounds
