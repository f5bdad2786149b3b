"""Bytes per device from live arrays, and collectives from the compiled step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, make_mesh
from jax.sharding import PartitionSpec as P

import zeroshard as zs
from zeroshard.core.update import Route
from zeroshard.measuring.scopes import scopes_of


def mlp_params(rng, dtype=jnp.float32):
    """A few thousand parameters, most in two matrices."""
    f = lambda *s: jnp.asarray(rng.normal(size=s) * 0.1, dtype)
    return {"l1": {"w": f(7, 61), "b": f(61)}, "l2": {"w": f(61, 53), "b": f(53)}, "l3": f(53, 5)}


def mlp_loss(p, batch):
    p = jax.tree.map(lambda x: x.astype(jnp.float32), p)
    h = jnp.tanh(batch["x"] @ p["l1"]["w"] + p["l1"]["b"])
    h = jnp.tanh(h @ p["l2"]["w"] + p["l2"]["b"])
    return jnp.mean((h @ p["l3"] - batch["y"]) ** 2)


def elementwise_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim or x.size > 1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adam_state_bytes_fall_by_n(n, rng):
    params = mlp_params(rng)
    inner = optax.adam(1e-3)
    replicated = inner.init(params)  # plain optax: what every device holds
    mu_nu = 2 * sum(x.size * 4 for x in jax.tree.leaves(params))
    mesh = make_mesh(n)
    tx = zs.sharded(inner, axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    got = zs.state_bytes_per_device(state.opt_state)
    scalars = 4 + 4 + 4  # adam's count (replicated), grad_norm, skipped
    assert zs.state_bytes_per_device(replicated) == mu_nu + 4
    leaves = len(jax.tree.leaves(params))
    padding = got - scalars - mu_nu / n
    # 1/N exactly, up to fewer than N padding elements per leaf (x2 moments, 4 bytes).
    assert 0 <= padding < 2 * 4 * n * leaves
    exact = 2 * 4 * sum(math.ceil(x.size / n) for x in jax.tree.leaves(params)) + scalars
    assert got == exact
    assert state.opt_state.master is None  # fp32 params are their own master


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bf16_params_master_and_moments_fall_by_n(n, rng):
    params = mlp_params(rng)
    mesh = make_mesh(n)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    size = sum(x.size for x in jax.tree.leaves(params))
    # Replicated mixed precision keeps per device: fp32 master + two fp32 moments.
    replicated = 3 * 4 * size
    got = zs.state_bytes_per_device(state.opt_state) - 8
    assert 0 <= got - replicated / n < 3 * 4 * n * len(jax.tree.leaves(params))
    assert zs.state_bytes_per_device(state.params) == 2 * size  # bf16, replicated


def data_parallel_step(loss_fn, inner, mesh):
    """The baseline: replicated plain optax, gradients all-reduced with pmean."""

    def local(params, opt_state, batch):
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), batch)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )


def large(found):
    return [c for c in found if c.result_bytes > 64]


@pytest.mark.parametrize("pack_bytes", [1 << 18, 0])
def test_collectives_of_the_compiled_step(pack_bytes, rng):
    n = 8
    params, mesh = mlp_params(rng), make_mesh(n)
    batch = {
        "x": jnp.asarray(rng.normal(size=(16, 7)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(16, 5)), jnp.float32),
    }
    tx = zs.sharded(optax.adam(1e-3), axis_name="data", pack_bytes=pack_bytes)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(mlp_loss, tx, mesh)
    found = zs.compiled_collectives(step.lower(state, batch).compile().as_text())
    kinds = zs.summarize(found)
    # Every leaf is small: packed into one collective each way, or one per leaf.
    expected = 1 if pack_bytes else len(jax.tree.leaves(params))
    assert kinds["reduce-scatter"]["count"] == expected
    assert kinds["all-gather"]["count"] == expected
    assert all(c.kind != "all-reduce" for c in large(found)), found  # scalars only
    assert all(c.result_bytes <= 16 for c in found if c.kind == "all-reduce")

    baseline = data_parallel_step(mlp_loss, optax.adam(1e-3), mesh)
    sharding = jax.NamedSharding(mesh, P())
    p = jax.device_put(params, sharding)
    s = jax.device_put(optax.adam(1e-3).init(params), sharding)
    b = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
    base = large(zs.compiled_collectives(baseline.lower(p, s, b).compile().as_text()))
    assert {c.kind for c in base} == {"all-reduce"}
    ours = sum(c.ring_bytes for c in large(found))
    theirs = sum(c.ring_bytes for c in base)
    assert ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.parametrize("reduce_dtype, expected_rs", [(None, "bf16"), (jnp.float32, "f32")])
def test_collective_dtypes_on_the_lowered_program(reduce_dtype, expected_rs, rng):
    params, mesh = mlp_params(rng), make_mesh(8)
    tx = zs.sharded(optax.adam(1e-3), axis_name="data", reduce_dtype=reduce_dtype)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    step = zs.make_train_step(mlp_loss, tx, mesh)
    batch = {"x": jnp.ones((8, 7)), "y": jnp.ones((8, 5))}
    dtypes = zs.collective_dtypes(step.lower(state, batch).as_text())
    assert [d for k, d in dtypes if k == "reduce-scatter"] == [expected_rs]  # one, packed
    # The compute dtype's bits: bf16 weights go as ui16 (2 bytes, exactly; XLA's CPU
    # backend would gather bf16 widened to f32).
    assert [d for k, d in dtypes if k == "all-gather"] == ["ui16"]


@pytest.mark.parametrize("pack_bytes", [1 << 18, 0])
def test_mixed_dtypes_each_leaf_on_the_wire_in_its_own_dtype(pack_bytes, rng):
    params, mesh = awkward_params(rng, small_dtype=jnp.bfloat16), make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", pack_bytes=pack_bytes)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    dtypes = zs.collective_dtypes(step.lower(state, batches(rng, 1)[0]).as_text())
    names = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}
    per_leaf = sorted(names[jnp.dtype(x.dtype)] for x in jax.tree.leaves(params))
    # All leaves are small: one collective per dtype when packed, else one per leaf.
    expected = ["bf16", "f32"] if pack_bytes else per_leaf
    assert sorted(d for k, d in dtypes if k == "reduce-scatter") == expected
    # (the weights' bits: bf16 as ui16, the same 2 bytes)
    bits = sorted("ui16" if d == "bf16" else d for d in expected)
    assert sorted(d for k, d in dtypes if k == "all-gather") == bits


def test_state_bytes_of_abstract_and_live_arrays_agree(rng):
    params, mesh = mlp_params(rng), make_mesh(4)
    tx = zs.sharded(optax.adam(1e-3), axis_name="data")
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(tx.init, params)
        live = tx.init(params)
    assert zs.state_bytes_per_device(abstract) == zs.state_bytes_per_device(live)
    assert np.all(np.asarray(live.grad_norm) == 0)


@pytest.mark.parametrize("stage", [1, 3])
def test_arrival_and_departure_bytes_are_the_compiled_programs(stage, rng):
    """Each arrival's and departure's byte count is what its collectives return in the
    compiled step (fp32, which the CPU's HLO prints as it is), owned leaves included."""
    n = 4
    params, mesh = mlp_params(rng), make_mesh(n)
    tx = zs.sharded(optax.contrib.muon(1e-3), axis_name="data", pack_bytes=0)
    loss = mlp_loss if stage < 3 else lambda p, b: mlp_loss(zs.gather(p), b)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(loss, tx, mesh, stage=stage)
    batch = {"x": jnp.ones((8, 7)), "y": jnp.ones((8, 5))}
    found = zs.compiled_collectives(step.lower(state, batch).compile().as_text())
    by_scope = lambda *names: sum(
        c.result_bytes for c in found if set(scopes_of(c.op_name)) & set(names)
    )
    plan, (arrival, departure) = tx.plan(params, n), Route.of(tx.config, stage)[:2]
    assert any(s.owned for s in plan.layout.slots)
    assert arrival.nbytes(plan) > 0 and departure.nbytes(plan) > 0
    if stage == 1:
        assert by_scope("reduce_scatter") == arrival.nbytes(plan)
        assert by_scope("all_gather") == departure.nbytes(plan)
    else:
        assert by_scope("to_owners") == arrival.nbytes(plan)  # muon reads no weights here
        assert by_scope("from_owners") == departure.nbytes(plan)


def test_fp8_collectives_count_one_byte_per_element():
    """An fp8 element type (``f8e4m3fn``: digits inside its name) is one byte."""
    line = (
        "  %ag = f8e4m3fn[8,64]{1,0} all-gather(f8e4m3fn[1,64]{1,0} %p), "
        "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"
    )
    (found,) = zs.compiled_collectives(line, num_devices=8)
    assert (found.kind, found.dtype, found.result_bytes) == ("all-gather", "f8e4m3fn", 512)
    bf16 = line.replace("f8e4m3fn", "bf16")
    assert zs.compiled_collectives(bf16, num_devices=8)[0].result_bytes == 1024
