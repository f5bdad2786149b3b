"""zeroshard on N devices vs plain optax on one device, same global batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    assert_within_bf16_rounding,
    awkward_loss,
    awkward_params,
    batches,
    make_mesh,
    reference_run,
)

import zeroshard as zs

STEPS = 4

OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.1), 1e-6),
    "sgd_momentum": (lambda: optax.sgd(0.1, momentum=0.9), 1e-6),
    "sgd_nesterov": (lambda: optax.sgd(0.1, momentum=0.9, nesterov=True), 1e-6),
    "adam": (lambda: optax.adam(1e-2), 1e-5),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), 1e-5),
    "lion": (lambda: optax.lion(1e-2, weight_decay=0.1), 1e-5),
    "adagrad": (lambda: optax.adagrad(1e-1), 1e-5),
    "rmsprop": (lambda: optax.rmsprop(1e-2), 1e-5),
}


def clipped_adamw(axis_name="data"):
    # The awkward model's gradient norm is ~1; 0.05 clips on every step.
    clip = zs.clip_by_global_norm(0.05, axis_name=axis_name)
    return optax.chain(clip, optax.adamw(1e-2, weight_decay=0.1))


def run_sharded(inner, params, data, n, **kwargs):
    mesh = make_mesh(n)
    tx = zs.sharded(inner, axis_name="data", **kwargs)
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        state, metrics = train_step(state, batch)
    return state, metrics


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parity_with_plain_optax(name, n, rng):
    make, rtol = OPTIMIZERS[name]
    params, data = awkward_params(rng), batches(rng, STEPS)
    expected = reference_run(awkward_loss, make(), params, data)
    state, _ = run_sharded(make(), params, data, n)
    assert_trees_close(state.params, expected, rtol)
    # The trajectory moved: a no-op optimizer cannot pass.
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e2 * rtol


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_parity_global_norm_clipping_that_clips(n, rng):
    params, data = awkward_params(rng), batches(rng, STEPS)
    reference = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1))
    expected = reference_run(awkward_loss, reference, params, data)
    state, metrics = run_sharded(clipped_adamw(), params, data, n)
    assert_trees_close(state.params, expected, 1e-5)
    # It really clipped: the unclipped run ends elsewhere.
    unclipped = reference_run(awkward_loss, optax.adamw(1e-2, weight_decay=0.1), params, data)
    assert not np.allclose(unclipped["out"]["w"], expected["out"]["w"], atol=1e-4)
    assert float(metrics["grad_norm"]) > 0.05


def params_and_masters(params, state):
    """The master weights (``None`` where none is kept) of each leaf of ``params``."""
    return jax.tree.leaves(
        jax.tree.map(lambda p, m: m, params, state.opt_state.master), is_leaf=lambda x: x is None
    )


@pytest.mark.parametrize("n", [1, 8])
def test_parity_mixed_dtype_tree_with_master(n, rng):
    """fp32 and bf16 leaves: two buckets; only the bf16 bucket gets an fp32 master."""
    params = awkward_params(rng, small_dtype=jnp.bfloat16)
    data = batches(rng, STEPS)
    dtypes = jax.tree.map(lambda x: x.dtype, params)
    expected = reference_run(awkward_loss, optax.sgd(0.1), params, data, dtypes, n)
    mesh = make_mesh(n)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", reduce_dtype=jnp.float32)
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        state, _ = train_step(state, batch)
    # Only bf16 leaves keep a master, all of them (alike leaves' pieces end to end in
    # one of theirs): as many elements as their pieces.
    pairs = zip(jax.tree.leaves(params), params_and_masters(params, state), strict=True)
    held = [m.size for p, m in pairs if m is not None and p.dtype == jnp.bfloat16]
    pieces = [-(-p.size // n) * n for p in jax.tree.leaves(params) if p.dtype == jnp.bfloat16]
    assert sum(held) == sum(pieces)
    assert len(held) == len(jax.tree.leaves(state.opt_state.master))
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(state.opt_state.master))
    assert jax.tree.map(lambda x: x.dtype, state.params) == dtypes
    master = zs.to_optax_state(state, tx)[0]  # the master weights, full
    if n == 1:
        assert_trees_close(master, expected, 1e-6)
    else:
        assert_within_bf16_rounding(master, expected, params)


@pytest.mark.parametrize("n", [1, 8])
def test_bf16_compute_fp32_master_trajectory(n, rng):
    params, data = awkward_params(rng), batches(rng, 6)
    expected = reference_run(awkward_loss, optax.sgd(0.1), params, data, jnp.bfloat16, n)
    mesh = make_mesh(n)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", reduce_dtype=jnp.float32)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        state, _ = train_step(state, batch)
    master = zs.to_optax_state(state, tx)[0]  # the master weights, full
    if n == 1:
        assert_trees_close(master, expected, 1e-6)
    else:
        assert_within_bf16_rounding(master, expected, params)
    # The master keeps fp32 precision (it is not a bf16 value) and the replicated
    # params are exactly its bf16 rounding.
    assert not np.array_equal(master["out"]["w"], master["out"]["w"].astype(jnp.bfloat16))
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(master), strict=True):
        np.testing.assert_array_equal(p, m.astype(jnp.bfloat16))
