"""2-D meshes: hierarchical sharding (a replica axis) and an axis left to the user."""

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, awkward_loss, awkward_params, batches, reference_run
from jax.sharding import AxisType

import zeroshard as zs


def hsdp_mesh(replicas: int = 2, shards: int = 4) -> jax.sharding.Mesh:
    return jax.make_mesh((replicas, shards), ("replica", "data"))


@pytest.mark.parametrize(
    "inner", [optax.sgd(0.1), optax.adamw(1e-2), optax.lamb(1e-2)], ids=["sgd", "adamw", "lamb"]
)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hierarchical_sharding_matches_plain_optax(inner, stage, rng):
    params, data = awkward_params(rng), batches(rng, 3)
    mesh = hsdp_mesh()
    tx = zs.sharded(inner, axis_name="data", replica_axis="replica")
    state = zs.init_train_state(params, tx, mesh, stage=stage)

    def loss_fn(p, batch):
        return awkward_loss(zs.gather(p) if stage == 3 else p, batch)

    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    full = lambda state: state.params if stage < 3 else zs.to_optax_state(state, tx)[0]
    for batch in data:
        before = jax.tree.map(np.asarray, full(state))  # the step donates the state
        state, metrics = step(state, batch)
    assert_trees_close(full(state), reference_run(awkward_loss, inner, params, data), 1e-5)
    loss, grads = jax.value_and_grad(awkward_loss)(before, data[-1])
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)


def test_hierarchical_stage2_through_gathers_matches_plain_optax(rng):
    """Stage 2 through a loss that gathers (zeroshard.training.held) on a replica axis: each
    gathered leaf's gradient is reduce-scattered over the sharding axis, then averaged
    over the replica axis, as plain optax's mean gradient."""
    params, data = awkward_params(rng), batches(rng, 3)
    mesh, inner = hsdp_mesh(), optax.adamw(1e-2)
    tx = zs.sharded(inner, axis_name="data", replica_axis="replica")
    state = zs.init_train_state(params, tx, mesh, stage=2)
    step = zs.make_train_step(lambda p, b: awkward_loss(zs.gather(p), b), tx, mesh, stage=2)
    for batch in data:
        state, _ = step(state, batch)
    assert_trees_close(state.params, reference_run(awkward_loss, inner, params, data), 1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_hierarchical_sharding_with_accumulation(stage, rng):
    """Micro-batches per device, then one all-reduce over the replicas per step."""
    params, data = awkward_params(rng), batches(rng, 2, size=32)
    mesh = hsdp_mesh()
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", replica_axis="replica")
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh, stage=stage, accum_steps=2)
    for batch in data:
        state, _ = step(state, batch)
    expected = reference_run(awkward_loss, optax.sgd(0.1), params, data)
    assert_trees_close(state.params, expected, 1e-5)


def test_hierarchical_state_is_sharded_within_and_replicated_across(rng):
    params = awkward_params(rng)
    mesh = hsdp_mesh()
    tx = zs.sharded(optax.adam(1e-3), axis_name="data", replica_axis="replica")
    state = zs.init_train_state(params, tx, mesh)
    mu = state.opt_state.inner_state[0].mu["dense"]["w"]
    assert mu.sharding.spec == jax.P(None, "data")
    assert mu.addressable_shards[0].data.shape == (1, -(-91 // 4))  # 1/4, not 1/8
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    one_axis = zs.init_train_state(params, zs.sharded(optax.adam(1e-3)), mesh4)
    assert zs.state_bytes_per_device(state.opt_state) == zs.state_bytes_per_device(
        one_axis.opt_state
    )


def test_hierarchical_collective_bytes_per_axis(rng):
    """Reduce-scatter and all-gather of whole leaves within "data"; across "replica"
    only an all-reduce of each device's 1/4 pieces (and scalars)."""
    params = awkward_params(rng)
    mesh = hsdp_mesh()
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", replica_axis="replica")
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    hlo = step.lower(state, batches(rng, 1)[0]).compile().as_text()
    kinds = zs.summarize(zs.compiled_collectives(hlo, mesh=mesh), per_axis=True)
    leaves = jax.tree.leaves(params)
    piece_bytes = sum(4 * -(-x.size // 4) for x in leaves)
    assert kinds["reduce-scatter over data"]["count"] == 1  # small leaves: packed
    assert kinds["reduce-scatter over data"]["bytes"] == piece_bytes
    assert kinds["all-gather over data"]["count"] == 1
    assert kinds["all-gather over data"]["bytes"] == sum(4 * 4 * -(-x.size // 4) for x in leaves)
    assert kinds["all-reduce over replica"]["bytes"] == piece_bytes  # 1/4 of the gradient
    assert kinds["all-reduce over replica"]["ring_bytes"] == piece_bytes  # 2(r-1)/r, r = 2
    assert {k for k in kinds if "replica" in k} == {
        "all-reduce over replica",
        "all-reduce over replica+data",  # the scalar loss
    }
    assert kinds["all-reduce over replica+data"]["bytes"] == 4


@pytest.mark.parametrize("stage", [1, 3])
def test_other_mesh_axis_is_left_to_the_loss(stage, rng):
    """A ("data", "model") mesh with an Auto model axis: the batch is split over
    "data" only, the state (and stage 3's weights) over "model" too, and kept so by
    the step (whose jit returns it laid out as it came: the types of a mesh with an
    Explicit axis say nothing of the Auto one); the result is plain optax's."""
    params, data = awkward_params(rng), batches(rng, 3)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    inner = optax.sgd(0.1, momentum=0.9)
    tx = zs.sharded(inner, axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=stage)

    def loss_fn(p, batch):
        return awkward_loss(zs.gather(p) if stage == 3 else p, batch)

    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    for batch in data:
        state, _ = step(state, batch)
    params_out = state.params if stage < 3 else zs.to_optax_state(state, tx)[0]
    assert_trees_close(params_out, reference_run(awkward_loss, inner, params, data), 1e-5)
    pieces = jax.tree.leaves((state.params if stage == 3 else (), state.opt_state.inner_state))
    for x in (x for x in pieces if x.size > 1):  # (a piece of each leaf per device of all 8)
        assert x.sharding.spec[-1] == ("data", "model")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_explicit_other_axis_trains(stage, rng):
    """jax 0.12.0.1 cannot lower a reduce-scatter in a partial-manual shard_map next to
    another Explicit axis. Stages 1-2 reduce manual over every axis (the update's
    nested shard_map), and stage 3's gathers (in the loss) and their transposes run
    manual over every axis too, so every stage trains on every jax."""
    params, data = awkward_params(rng), batches(rng, 1)
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # both Explicit
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    loss = (lambda p, b: awkward_loss(zs.gather(p), b)) if stage == 3 else awkward_loss
    step = zs.make_train_step(loss, tx, mesh, stage=stage)
    state, _ = step(state, data[0])
    full = state.params if stage < 3 else zs.to_optax_state(state, tx)[0]
    assert_trees_close(full, reference_run(awkward_loss, optax.sgd(0.1), params, data), 1e-5)


def test_replica_axis_errors(rng):
    with pytest.raises(ValueError, match="must differ"):
        zs.sharded(optax.sgd(0.1), axis_name="data", replica_axis="data")
    with pytest.raises(TypeError, match="replica_axis must be a mesh axis name"):
        zs.sharded(optax.sgd(0.1), replica_axis=3)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", replica_axis="hosts")
    with pytest.raises(ValueError, match="no such axis"):
        zs.make_train_step(awkward_loss, tx, hsdp_mesh())
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", replica_axis="replica")
    mesh = hsdp_mesh()
    state = zs.init_train_state(awkward_params(rng), tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    with pytest.raises(
        ValueError, match=r"divisible by the 8 devices of axes \('replica', 'data'\)"
    ):
        step(state, batches(rng, 1, size=12)[0])
    np.testing.assert_equal(int(state.step), 0)
