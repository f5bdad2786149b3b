"""Logical layout: zeroshard <-> plain optax, on any device count."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, awkward_loss, awkward_params, batches, make_mesh

import zeroshard as zs


def divisible_params(rng):
    """Leaves whose first dimension divides by 8 (converted locally) beside awkward ones."""
    params = awkward_params(rng)
    params["dense"]["w"] = jnp.asarray(rng.normal(size=(8, 13)) * 0.5, jnp.float32)
    params["dense"]["w2"] = jnp.asarray(rng.normal(size=(7, 13)) * 0.5, jnp.float32)
    params["wide"] = jnp.asarray(rng.normal(size=(3, 16)) * 0.5, jnp.float32)  # split on dim 1
    return params


def loss(params, batch):
    x = batch["x"] @ jnp.ones((7, 8)) / 7
    h = jnp.tanh(x @ params["dense"]["w"] + batch["x"] @ params["dense"]["w2"])
    p = dict(params, dense={"w": params["dense"]["w2"], "b": params["dense"]["b"]})
    wide = jnp.mean(jnp.tanh(batch["x"][:, :3] @ params["wide"]) ** 2)
    return awkward_loss(p, batch) + jnp.mean(h**2) + wide


def plain_steps(inner, params, opt_state, data):
    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = inner.update(jax.grad(loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in data:
        params, opt_state = step(params, opt_state, batch)
    return params, opt_state


def sharded_steps(tx, state, mesh, data):
    train_step = zs.make_train_step(loss, tx, mesh)
    for batch in data:
        state, _ = train_step(state, batch)
    return state, train_step


INNERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "chain_clip_sgd_momentum": lambda: optax.chain(
        zs.clip_by_global_norm(0.5, axis_name="data"), optax.sgd(0.05, momentum=0.9)
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}
PLAIN = {
    "adamw": INNERS["adamw"],
    "chain_clip_sgd_momentum": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.sgd(0.05, momentum=0.9)
    ),
    "inject_hyperparams": INNERS["inject_hyperparams"],
}


@pytest.mark.parametrize("name", sorted(INNERS))
def test_zeroshard_run_continues_under_plain_optax(name, rng):
    params, data = divisible_params(rng), batches(rng, 6)
    mesh = make_mesh(8)
    tx = zs.sharded(INNERS[name](), axis_name="data")
    state, _ = sharded_steps(tx, zs.init_train_state(params, tx, mesh), mesh, data[:3])
    p, s = zs.to_optax_state(state, tx)
    plain = PLAIN[name]()
    assert jax.tree.structure(s) == jax.tree.structure(plain.init(params))
    p, s = plain_steps(plain, p, s, data[3:])
    expected, _ = plain_steps(plain, params, plain.init(params), data)
    assert_trees_close(p, expected, 1e-5)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("name", sorted(INNERS))
def test_plain_optax_run_continues_under_zeroshard(name, n, rng):
    params, data = divisible_params(rng), batches(rng, 6)
    plain = PLAIN[name]()
    p, s = plain_steps(plain, params, plain.init(params), data[:3])
    mesh = make_mesh(n)
    tx = zs.sharded(INNERS[name](), axis_name="data")
    state = zs.from_optax_state(p, s, tx, mesh, step=3)
    state, _ = sharded_steps(tx, state, mesh, data[3:])
    expected, _ = plain_steps(plain, params, plain.init(params), data)
    assert int(state.step) == 6
    assert_trees_close(state.params, expected, 1e-5)


@pytest.mark.parametrize("param_dtype", [None, jnp.bfloat16])
def test_round_trip_is_exact_and_does_not_recompile(param_dtype, rng):
    params, data = divisible_params(rng), batches(rng, 4)
    mesh = make_mesh(8)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, param_dtype=param_dtype)
    state, train_step = sharded_steps(tx, state, mesh, data[:2])
    p, s = zs.to_optax_state(state, tx)
    assert {x.dtype for x in jax.tree.leaves(p)} == {jnp.dtype(jnp.float32)}  # the master
    assert p["dense"]["w"].sharding.spec[0] == "data"  # 8 rows: split, not gathered
    assert p["wide"].sharding.spec[1] == "data"  # 3 x 16: split along the 16
    assert p["dense"]["w2"].sharding.is_fully_replicated  # 7 x 13: nothing divides by 8
    back = zs.from_optax_state(p, s, tx, mesh, param_dtype=param_dtype, step=state.step)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        assert a.sharding == b.sharding
    # Bit-identical, but for grad_norm: a diagnostic of the last step, not saved.
    assert float(back.opt_state.grad_norm) == 0
    same = lambda t: (t.step, t.params, t.opt_state.inner_state, t.opt_state.master)
    for a, b in zip(jax.tree.leaves(same(back)), jax.tree.leaves(same(state)), strict=True):
        np.testing.assert_array_equal(a, b)
    for batch in data[2:]:
        back, _ = train_step(back, batch)
    assert train_step.jitted._cache_size() == 1


def test_mismatched_optimizer_state_names_the_leaf(rng):
    params = divisible_params(rng)
    tx = zs.sharded(optax.adam(1e-2), axis_name="data")
    state = optax.adam(1e-2).init(params)
    bad = state[0]._replace(mu={**state[0].mu, "out": {"w": jnp.zeros((5, 13))}})
    with pytest.raises(ValueError, match=r"optimizer state: leaf \[0\]\.mu\['out'\]\['w'\]"):
        zs.from_optax_state(params, (bad, state[1]), tx, make_mesh(8))
    with pytest.raises(ValueError, match="tree structure"):
        zs.from_optax_state(params, optax.sgd(0.1).init(params), tx, make_mesh(8))
