"""``tx.value_and_grad`` in the user's own ``jax.jit``: zeroshard's gradient, taken by
``tx.update`` with no further gradient collective, is ``zs.make_train_step``'s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    awkward_loss,
    awkward_params,
    batches,
    layered_loss,
    layered_params,
    reference_run,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs

OPTIONS = {
    "exact": ({}, 1),
    "accumulated": ({}, 2),
    "int8": ({"quantize_grads": "int8"}, 1),
    "int8-accumulated": ({"quantize_grads": "int8"}, 2),
    "deterministic": ({"deterministic": 16}, 1),
    "replica": ({"replica_axis": "replica"}, 1),
}
INNERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def mesh_for(options: dict) -> jax.sharding.Mesh:
    if "replica_axis" in options:
        return jax.make_mesh((2, 4), ("replica", "data"))
    return jax.make_mesh((8,), ("data",))


def user_step(tx, accum_steps: int = 1):
    """The user's own step: tx.value_and_grad, tx.update, optax.apply_updates."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = tx.value_and_grad(awkward_loss, accum_steps=accum_steps)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, updates

    return step


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_step_is_make_train_steps_bit_for_bit(option, inner, stage):
    """From the same weights, one step through tx.value_and_grad and tx.update gives
    make_train_step's loss and optimizer state bit for bit, and updates that are
    exactly its new weights minus the old."""
    options, accum = OPTIONS[option]
    params, mesh = awkward_params(np.random.default_rng(0)), mesh_for(options)
    (batch,) = batches(np.random.default_rng(1), 1, size=32)
    tx = zs.sharded(INNERS[inner](), stage=stage, **options)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    own = zs.make_train_step(awkward_loss, tx, mesh, stage=stage, accum_steps=accum)
    new_state, metrics = own(state, batch)
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        _, opt_state, loss, updates = user_step(tx, accum)(p, tx.init(p), batch)
    assert np.asarray(loss) == np.asarray(metrics["loss"])
    own_leaves, user_leaves = (jax.tree.leaves(s) for s in (new_state.opt_state, opt_state))
    assert len(own_leaves) == len(user_leaves)
    for a, b in zip(own_leaves, user_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    moved = jax.tree.map(lambda n, o: np.asarray(n) - np.asarray(o), new_state.params, params)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("inner", list(INNERS))
def test_three_steps_give_plain_optax(inner, stage):
    """Three steps of the user's step give plain optax's weights on one device on the
    global batch."""
    params, mesh = awkward_params(np.random.default_rng(2)), mesh_for({})
    data = batches(np.random.default_rng(3), 3, size=32)
    tx = zs.sharded(INNERS[inner](), stage=stage)
    step = user_step(tx)
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        opt_state = tx.init(p)
        for batch in data:
            p, opt_state, _, _ = step(p, opt_state, batch)
    expected = reference_run(awkward_loss, INNERS[inner](), params, data)
    assert_trees_close(p, expected, rtol=1e-5)


def test_no_gradient_all_reduce_in_the_users_step():
    """The user's step reduce-scatters the gradients and all-gathers the new weights;
    what it all-reduces are scalars (the loss and the gradient norm)."""
    params, mesh = awkward_params(np.random.default_rng(4)), mesh_for({})
    (batch,) = batches(np.random.default_rng(5), 1, size=32)
    tx = zs.sharded(optax.adam(1e-2))
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        text = user_step(tx).lower(p, tx.init(p), batch).compile().as_text()
    found = zs.compiled_collectives(text, mesh=mesh)
    kinds = {c.kind for c in found}
    assert "reduce-scatter" in kinds and "all-gather" in kinds, kinds
    assert all(c.result_bytes <= 8 for c in found if c.kind == "all-reduce"), found


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dynamic_loss_scaling_with_the_loss_scaled_by_hand(stage):
    """With ``loss_scale=`` the user multiplies the loss by the state's scale, as with
    jax.grad, passed as a keyword argument: two steps, the second's gradient infinite,
    give make_train_step's optimizer state bit for bit (the step skipped, the scale
    halved, the count of skipped steps 1), and its losses times the scale."""
    params, mesh = awkward_params(np.random.default_rng(8)), mesh_for({})
    data = batches(np.random.default_rng(9), 2, size=32)
    data[1]["x"] = data[1]["x"].at[3, 0].set(jnp.inf)
    scaling = zs.DynamicLossScale(initial=2.0**10)
    tx = zs.sharded(optax.adam(1e-2), stage=stage, loss_scale=scaling)
    read = zs.gather if stage == 3 else lambda p: p
    own_loss = lambda p, b: awkward_loss(read(p), b)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    own = zs.make_train_step(own_loss, tx, mesh, stage=stage)
    own_metrics = []
    for batch in data:
        state, metrics = own(state, batch)
        own_metrics.append(metrics)

    @jax.jit
    def step(params, opt_state, batch):
        scaled = lambda p, b, scale: own_loss(p, b) * scale
        loss, grads = tx.value_and_grad(scaled)(params, batch, scale=opt_state.loss_scale.scale)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        p = tx.shard_params(p) if stage == 3 else p
        opt_state, losses = tx.init(p), []
        for batch in data:
            p, opt_state, loss = step(p, opt_state, batch)
            losses.append(loss)
    assert float(losses[0]) == float(own_metrics[0]["loss"]) * 2.0**10
    assert int(opt_state.skipped) == 1 and float(opt_state.loss_scale.scale) == 2.0**9
    own_leaves, user_leaves = (jax.tree.leaves(s) for s in (state.opt_state, opt_state))
    for a, b in zip(own_leaves, user_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_an_indivisible_batch_is_refused():
    params, mesh = awkward_params(np.random.default_rng(6)), mesh_for({})
    (batch,) = batches(np.random.default_rng(7), 1, size=12)
    tx = zs.sharded(optax.sgd(0.1))
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        with pytest.raises(ValueError, match="12"):
            user_step(tx)(p, tx.init(p), batch)
    assert jnp.ndim(p["scale"]) == 0  # (the weights are untouched)


@pytest.mark.parametrize(
    "inner, option", [("sgd", "exact"), ("sgd", "accumulated")] + [("adam", o) for o in OPTIONS]
)
def test_stage3_one_step_is_make_train_steps_bit_for_bit(inner, option):
    """Stage 3: the drop-in's weights (tx.shard_params), read through zs.layer in the
    loss, give make_train_step's loss and optimizer state bit for bit, with every
    option (a replica axis: the weights' pieces copied over it)."""
    (options, accum), rng = OPTIONS[option], np.random.default_rng(9)
    params, mesh = layered_params(np.random.default_rng(8), width=64), mesh_for(options)
    batch = {k: jnp.asarray(rng.normal(size=(32, 64)), jnp.float32) for k in ("x", "y")}
    loss = lambda p, b: layered_loss(p, b, stage=3)
    tx = zs.sharded(INNERS[inner](), stage=3, **options)
    own = zs.make_train_step(loss, tx, mesh, stage=3, accum_steps=accum)
    new_state, metrics = own(zs.init_train_state(params, tx, mesh, stage=3), batch)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = tx.value_and_grad(loss, accum_steps=accum)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.set_mesh(mesh):
        p = tx.shard_params(jax.device_put(params, NamedSharding(mesh, P())))
        p, opt_state, value = step(p, tx.init(p), batch)
    assert np.asarray(value) == np.asarray(metrics["loss"])
    for a, b in zip(jax.tree.leaves(new_state.opt_state), jax.tree.leaves(opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("inner", list(INNERS))
def test_apply_gradients_gives_make_train_steps_weights_bit_for_bit(inner, stage):
    """tx.apply_gradients, tx.update and optax.apply_updates in one, returns the new
    weights themselves: after tx.value_and_grad, make_train_step's weights and
    optimizer state bit for bit (stage 3: the weights from tx.shard_params, read
    through zs.layer). After jax.grad (the one line; stage 3 with the marks), the state
    tx.update makes, bit for bit, and three steps give plain optax's weights."""
    rng = np.random.default_rng(10)
    params, mesh = layered_params(np.random.default_rng(11), width=64), mesh_for({})
    data = [{k: jnp.asarray(rng.normal(size=(32, 64)), jnp.float32) for k in "xy"} for _ in "abc"]
    loss = lambda p, b: layered_loss(p, b, stage=stage)
    tx = zs.sharded(INNERS[inner](), stage=stage)
    own = zs.make_train_step(loss, tx, mesh, stage=stage)
    new_state, _ = own(zs.init_train_state(params, tx, mesh, stage=stage), data[0])

    @functools.partial(jax.jit, static_argnames="grad")
    def step(params, opt_state, batch, grad):
        grads = tx.value_and_grad(loss)(params, batch)[1] if grad == "tx" else grad(params, batch)
        return tx.apply_gradients(grads, opt_state, params)

    @jax.jit
    def updated(params, opt_state, batch):
        return tx.update(jax.grad(loss)(params, batch), opt_state, params)[1]

    with jax.set_mesh(mesh):
        placed = jax.device_put(params, NamedSharding(mesh, P()))
        placed = tx.shard_params(placed) if stage == 3 else placed
        one = step(placed, tx.init(placed), data[0], "tx")
        p, opt_state, grad = placed, tx.init(placed), jax.grad(loss)
        for i, batch in enumerate(data):
            p, opt_state = step(p, opt_state, batch, grad)
            if i == 0:
                expected = updated(placed, tx.init(placed), batch)
                for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(opt_state), strict=True):
                    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        final = zs.to_optax_state(zs.TrainState(new_state.step, p, opt_state, None), tx)[0]
    own_params = zs.to_optax_state(new_state, tx)[0]
    user = zs.to_optax_state(zs.TrainState(new_state.step, one[0], one[1], None), tx)[0]
    for a, b in zip(jax.tree.leaves(own_params), jax.tree.leaves(user), strict=True):
        np.testing.assert_array_equal(b, np.asarray(a))
    for a, b in zip(jax.tree.leaves(new_state.opt_state), jax.tree.leaves(one[1]), strict=True):
        np.testing.assert_array_equal(b, np.asarray(a))
    assert_trees_close(final, reference_run(layered_loss, INNERS[inner](), params, data), 1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_on_a_tensor_parallel_mesh(stage):
    """4 data x 2 model (Auto axes), column/row-parallel weights: plain optax's
    weights on one device, kept in their "model" layout, and the state 1/8 per device."""
    rng = np.random.default_rng(10)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
    params = {"up": f(16, 64), "down": f(64, 16), "b": f(16)}
    specs = {"up": P(None, "model"), "down": P("model", None), "b": P()}
    data = [{"x": f(32, 16), "y": f(32, 16)} for _ in range(3)]

    def loss_fn(p, batch):
        return jnp.mean((jax.nn.relu(batch["x"] @ p["up"]) @ p["down"] + p["b"] - batch["y"]) ** 2)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = zs.sharded(optax.adam(1e-2), stage=stage)

    @functools.partial(jax.jit, static_argnums=3)
    def step(params, opt_state, batch, layout=True):
        # (on Auto axes the traced weights show no layout: the state's says it)
        made = opt_state.layout if layout else None
        _, grads = tx.value_and_grad(loss_fn, layout=made)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):
        p = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        opt_state = tx.init(p)
        with pytest.raises(ValueError, match="layout=opt_state.layout"):
            step(p, opt_state, data[0], False)
        for batch in data:
            p, opt_state = step(p, opt_state, batch)
    assert_trees_close(p, reference_run(loss_fn, optax.adam(1e-2), params, data), rtol=1e-5)
    for k, v in p.items():
        assert v.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), v.ndim), k
    mu = opt_state.inner_state[0].mu["up"]
    assert {s.data.size for s in mu.addressable_shards} == {mu.size // 8}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_the_learning_rate_set_mid_run_with_optax_tree_set(inner, stage):
    """optax.tree_utils.tree_set on the state of optax.inject_hyperparams between two
    steps of the user's step: the new rate is read back and taken, as plain optax
    takes it on one device on the global batch."""
    make = {
        "sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
        "adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    }[inner]
    new_rate = {"sgd": 0.4, "adam": 5e-2}[inner]
    params = awkward_params(np.random.default_rng(11))
    data = batches(np.random.default_rng(12), 4, size=32)
    # (stage 3: the weights read through zs.gather, as zeroshard's step reads them)
    loss = (lambda p, b: awkward_loss(zs.gather(p), b)) if stage == 3 else awkward_loss
    tx, mesh = zs.sharded(make(), stage=stage), mesh_for({})

    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = tx.update(tx.value_and_grad(loss)(params, batch)[1], opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        p = tx.shard_params(p) if stage == 3 else p
        opt_state = tx.init(p)
        for i, batch in enumerate(data):
            if i == 2:
                opt_state = optax.tree_utils.tree_set(
                    opt_state, learning_rate=jnp.asarray(new_rate)
                )
            p, opt_state = step(p, opt_state, batch)
    assert optax.tree_utils.tree_get(opt_state, "learning_rate") == new_rate
    reference = make()
    plain, plain_state = params, reference.init(params)
    for i, batch in enumerate(data):
        if i == 2:
            plain_state = optax.tree_utils.tree_set(
                plain_state, learning_rate=jnp.asarray(new_rate)
            )
        updates, plain_state = reference.update(
            jax.grad(awkward_loss)(plain, batch), plain_state, plain
        )
        plain = optax.apply_updates(plain, updates)
    got = jax.tree.map(np.asarray, jax.device_get(zs.gather(p) if stage == 3 else p))
    assert_trees_close(got, plain, rtol=1e-5)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_loss_whose_sharding_calls_fail_per_device_runs_on_the_whole_mesh(rng, stage, replicas):
    """The MLP of test_step_whole_mesh.py on a 4 x 2 Explicit mesh (or 2 replicas x 2 x
    2, ``replica_axis=``), its second matmul's output laid out over the batch axes by
    the model itself, which jax refuses per device: tx.value_and_grad differentiates
    it on the whole mesh instead (jax.grad's mean gradient, which tx.update takes), as
    make_train_step does: plain optax's numbers."""
    from jax.sharding import AxisType
    from test_step_whole_mesh import data_and_params, mlp_loss, plain_run

    params, data = data_and_params(rng)
    shape, axes, options = (4, 2), ("data", "model"), {}
    if replicas > 1:
        shape, axes, options = (2, 2, 2), ("replica", *axes), {"replica_axis": "replica"}
    mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(axes))
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    tx = zs.sharded(optax.adam(1e-2), axis_name="data", stage=stage, **options)
    rows = P(axes[:-1], None)
    read = zs.gather if stage == 3 else lambda p: p  # (stage 3 reads pieces so)
    loss_fn = lambda p, b: mlp_loss(read(p), b, out_sharding=rows)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = tx.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
        laid = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        laid = tx.shard_params(laid) if stage == 3 else laid
        opt_state, losses = tx.init(laid), []
        for batch in data:
            laid, opt_state, loss = step(laid, opt_state, batch)
            losses.append(float(loss))
        with pytest.raises(ValueError, match="cannot contain axis names") as refused:
            jax.jit(tx.value_and_grad(loss_fn, accum_steps=2))(laid, data[0])
    plain_losses, plain = plain_run(optax.adam(1e-2), params, data)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert_trees_close(laid, plain, 1e-5)
    assert any("accum_steps=2" in note for note in refused.value.__notes__)


def test_a_traced_value_closed_over_by_the_loss_is_refused_naming_the_keyword_way():
    """jax's shard_map refuses a value of the traced step closed over by the loss on a
    mesh with Explicit axes; the note says to pass it as a keyword argument."""
    from jax.sharding import AxisType

    params = awkward_params(np.random.default_rng(10))
    (batch,) = batches(np.random.default_rng(11), 1, size=32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    tx = zs.sharded(optax.sgd(0.1))

    @jax.jit
    def closed(params, batch, scale):
        return tx.value_and_grad(lambda p, b: awkward_loss(p, b) * scale)(params, batch)[0]

    @jax.jit
    def passed(params, batch, scale):
        scaled = lambda p, b, scale: awkward_loss(p, b) * scale
        return tx.value_and_grad(scaled)(params, batch, scale=scale)[0]

    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        with pytest.raises(NotImplementedError) as refused:
            closed(p, batch, jnp.float32(2.0))
        assert any("keyword argument" in note for note in refused.value.__notes__)
        assert float(passed(p, batch, jnp.float32(2.0))) > 0
