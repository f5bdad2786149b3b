"""Flax NNX and Linen loops under zeroshard vs the same loops with plain optax."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from helpers import (
    assert_trees_close,
    assert_within_bf16_rounding,
    batches,
    make_mesh,
    reference_run,
)

import zeroshard as zs
import zeroshard.flax as zf
from zeroshard.checkpointing import ShardedRestore, ShardedSave


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(7, 13, rngs=rngs)
        self.norm = nnx.LayerNorm(13, rngs=rngs)
        self.l2 = nnx.Linear(13, 5, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.norm(jnp.tanh(self.l1(x))))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(nn.LayerNorm()(jnp.tanh(nn.Dense(13)(x))))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


OPTIMIZERS = {"sgd": (lambda: optax.sgd(0.1), 1e-6), "adamw": (lambda: optax.adamw(1e-2), 1e-5)}


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nnx_optimizer_matches_plain_optax(name, n, rng):
    make, rtol = OPTIMIZERS[name]
    data, mesh = batches(rng, 4), make_mesh(n)
    model, reference = NNXModel(nnx.Rngs(0)), NNXModel(nnx.Rngs(0))
    optimizer = zf.nnx_optimizer(model, zs.sharded(make(), axis_name="data"), mesh)
    train_step = zf.nnx_train_step(nnx_loss, mesh)
    ref_optimizer = nnx.Optimizer(reference, make(), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer, batch):
        optimizer.update(model, nnx.grad(nnx_loss)(model, batch))

    for batch in data:
        metrics = train_step(model, optimizer, batch)
        ref_step(reference, ref_optimizer, batch)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param), rtol)
    assert int(optimizer.step[...]) == len(data)
    assert len(train_step._compiled) == 1  # one compilation for all steps
    # The parameters stay replicated; the moments stay sharded.
    kernel = model.l1.kernel[...]
    assert kernel.sharding.is_fully_replicated
    if name == "adamw":
        mu = optimizer.opt_state.inner_state[0].mu["l1"]["kernel"][...]
        assert mu.sharding.spec[-1] == "data"
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_linen_train_state_matches_plain_optax(name, n, rng):
    make, rtol = OPTIMIZERS[name]
    data, mesh, model = batches(rng, 4), make_mesh(n), LinenModel()
    params = model.init(jax.random.key(0), jnp.ones((1, 7)))["params"]

    def loss_fn(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    tx = zs.sharded(make(), axis_name="data")
    state = zf.linen_train_state(model.apply, params, tx, mesh)
    train_step = zf.linen_train_step(loss_fn, tx, mesh)
    for batch in data:
        state, metrics = train_step(state, batch)
    assert_trees_close(state.params, reference_run(loss_fn, make(), params, data), rtol)
    assert int(state.step) == len(data)
    assert train_step.jitted._cache_size() == 1
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0


def test_flax_steps_report_a_skipped_step(rng):
    """An inf in one device's rows: the step is skipped everywhere and says so."""
    data, mesh = batches(rng, 2), make_mesh(8)
    bad = {k: np.array(v) for k, v in data[1].items()}
    bad["y"][3, 0] = np.inf
    model = NNXModel(nnx.Rngs(0))
    optimizer = zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.1)), mesh)
    nnx_step = zf.nnx_train_step(nnx_loss, mesh)
    linen = LinenModel()
    params = linen.init(jax.random.key(0), jnp.ones((1, 7)))["params"]
    tx = zs.sharded(optax.sgd(0.1))
    state = zf.linen_train_state(linen.apply, params, tx, mesh)
    loss_fn = lambda p, b: jnp.mean((linen.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    linen_step = zf.linen_train_step(loss_fn, tx, mesh)
    reported = []
    for batch in (data[0], bad):
        metrics = nnx_step(model, optimizer, batch)
        state, linen_metrics = linen_step(state, batch)
        reported.append((int(metrics["skipped"]), int(linen_metrics["skipped"])))
        assert "loss_scale" not in metrics and "loss_scale" not in linen_metrics
    assert reported == [(0, 0), (1, 1)]
    assert int(optimizer.opt_state.skipped[...]) == int(state.opt_state.skipped) == 1


def test_linen_bf16_compute_keeps_an_fp32_master(rng):
    data, mesh, model = batches(rng, 3), make_mesh(8), LinenModel()
    params = model.init(jax.random.key(0), jnp.ones((1, 7)))["params"]

    def loss_fn(p, batch):
        p = jax.tree.map(lambda x: x.astype(jnp.float32), p)
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    tx = zs.sharded(optax.sgd(0.1), axis_name="data", reduce_dtype=jnp.float32)
    state = zf.linen_train_state(model.apply, params, tx, mesh, param_dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    train_step = zf.linen_train_step(loss_fn, tx, mesh)
    for batch in data:
        state, _ = train_step(state, batch)
    expected = reference_run(loss_fn, optax.sgd(0.1), params, data, jnp.bfloat16, 8)
    master = zs.to_optax_state(zs.TrainState(state.step, state.params, state.opt_state), tx)[0]
    assert_within_bf16_rounding(master, expected, params)


def test_nnx_step_rejects_an_indivisible_batch(rng):
    mesh, model = make_mesh(8), NNXModel(nnx.Rngs(0))
    optimizer = zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.1)), mesh)
    with pytest.raises(ValueError, match="divisible by the 8 devices"):
        zf.nnx_train_step(nnx_loss, mesh)(model, optimizer, batches(rng, 1, size=12)[0])
    with pytest.raises(ValueError, match="mesh has no axis"):
        zf.nnx_train_step(nnx_loss, mesh, axis_name="model")


FEATURES = {  # the optimizer's options, the step's, the mesh
    "stage2-accum2": ({}, {"stage": 2, "accum_steps": 2}, (8,)),
    "loss_scale": ({"loss_scale": zs.DynamicLossScale(2.0**10)}, {}, (8,)),
    "replica_axis": ({"replica_axis": "replica"}, {"accum_steps": 2}, (2, 4)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_flax_steps_match_make_train_step(feature, rng):
    """Each Flax step is make_train_step on the model's parameters: the same weights,
    optimizer state and metrics, with stage 2, accumulation, loss scaling or a
    replica axis (hierarchical sharding)."""
    tx_options, step_options, shape = FEATURES[feature]
    names = ("data",) if len(shape) == 1 else ("replica", "data")
    mesh = jax.make_mesh(shape, names)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data", **tx_options)
    data = batches(rng, 2)
    nnx_model, linen = NNXModel(nnx.Rngs(0)), LinenModel()
    graphdef, nnx_params, rest = nnx.split(nnx_model, nnx.Param, ...)
    nnx_params = nnx.to_pure_dict(nnx_params)
    linen_params = linen.init(jax.random.key(0), jnp.ones((1, 7)))["params"]
    linen_loss = lambda p, b: jnp.mean((linen.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    merged_loss = lambda p, b: nnx_loss(nnx.merge(graphdef, nnx.State(p), rest), b)

    def functional(loss, params):
        state = zs.init_train_state(params, tx, mesh, stage=step_options.get("stage", 1))
        step = zs.make_train_step(loss, tx, mesh, **step_options)
        for batch in data:
            state, metrics = step(state, batch)
        return state, metrics

    optimizer = zf.nnx_optimizer(nnx_model, tx, mesh)
    nnx_step = zf.nnx_train_step(nnx_loss, mesh, **step_options)
    linen_state = zf.linen_train_state(linen.apply, linen_params, tx, mesh)
    linen_step = zf.linen_train_step(linen_loss, tx, mesh, **step_options)
    for batch in data:
        nnx_metrics = nnx_step(nnx_model, optimizer, batch)
        linen_state, linen_metrics = linen_step(linen_state, batch)
    for (state, metrics), params, opt_state, got in (
        (
            functional(merged_loss, nnx_params),
            nnx.to_pure_dict(nnx.state(nnx_model, nnx.Param)),
            nnx.as_pure(optimizer.opt_state),
            nnx_metrics,
        ),
        (
            functional(linen_loss, linen_params),
            linen_state.params,
            linen_state.opt_state,
            linen_metrics,
        ),
    ):
        assert_trees_close(params, state.params, 1e-6)
        assert_trees_close(opt_state, state.opt_state, 1e-6)
        assert sorted(got) == sorted(metrics)
        assert_trees_close(got, metrics, 1e-6)
    assert int(optimizer.step[...]) == int(linen_state.step) == len(data)
    if "loss_scale" in tx_options:
        assert float(nnx_metrics["loss_scale"]) == float(linen_metrics["loss_scale"]) == 2.0**10


# Stage 3: Flax layers that gather their own weights.


def stage3_data(rng, steps=3):
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(16, 16), "y": f(16, 16)} for _ in range(steps)]


def check_stage3(params, plain_loss, stage3_loss, data, layers):
    """Trains stage 3 on 8 devices; checks it against plain optax and that each of the
    ``layers`` gathers its weights (one reduce-scatter each, the gather's transpose;
    gathered again in the backward pass where that layer's backward recomputes)."""
    mesh, tx = make_mesh(8), zs.sharded(optax.adamw(1e-2), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=3)
    step = zs.make_train_step(stage3_loss, tx, mesh, stage=3)
    for batch in data:
        state, _ = step(state, batch)
    expected = reference_run(plain_loss, optax.adamw(1e-2), params, data)
    assert_trees_close(zs.to_optax_state(state, tx)[0], expected, 1e-5)
    kinds = [c.kind for c in zs.lowered_collectives(step.lower(state, data[0]).as_text())]
    assert kinds.count("reduce-scatter") == layers
    assert layers < kinds.count("all-gather") <= 2 * layers
    return state


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = jnp.tanh(nn.Dense(16, name=f"d{i}")(x))
        return x


def test_linen_stage3_gathers_per_layer_and_matches_plain_optax(rng, tmp_path):
    plain = LinenStack()
    params = plain.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
    data = stage3_data(rng)

    def plain_loss(p, b):
        return jnp.mean((plain.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    def stage3_loss(p, b):
        x = b["x"]
        for i in range(3):
            x = jnp.tanh(zf.linen_layer(nn.Dense(16))(p[f"d{i}"], x))
        return jnp.mean((x - b["y"]) ** 2)

    check_stage3(params, plain_loss, stage3_loss, data, layers=3)
    mesh, tx = make_mesh(8), zs.sharded(optax.adamw(1e-2), axis_name="data")
    state = zf.linen_train_state(plain.apply, params, tx, mesh, stage=3)
    step = zf.linen_train_step(stage3_loss, tx, mesh, stage=3)
    for batch in data:
        state, _ = step(state, batch)
    functional = zs.TrainState(state.step, state.params, state.opt_state)
    expected = reference_run(plain_loss, optax.adamw(1e-2), params, data)
    assert_trees_close(zs.to_optax_state(functional, tx)[0], expected, 1e-5)
    # The user's orbax manager restores a stage-3 Linen state as stage-3 pieces.
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, args=ocp.args.Composite(train_state=ShardedSave(state)))
        mngr.wait_until_finished()
        target = zf.linen_train_state(plain.apply, params, tx, mesh, stage=3)
        args = ocp.args.Composite(train_state=ShardedRestore(target))
        restored = mngr.restore(1, args=args).train_state
    assert all(isinstance(x, zs.Piece) for x in _shards(restored.params))
    restored = zs.TrainState(restored.step, restored.params, restored.opt_state)
    jax.tree.map(
        np.testing.assert_array_equal,
        zs.to_optax_state(restored, tx),
        zs.to_optax_state(functional, tx),
    )


def _shards(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, zs.Piece))


class NNXStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(3)])
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.norm(x)


def test_nnx_stage3_gathers_per_layer_and_matches_plain_optax(rng):
    model, data = NNXStack(nnx.Rngs(0)), stage3_data(rng)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)

    def plain_loss(p, b):
        out = nnx.merge(graphdef, nnx.State(p), rest)(b["x"])
        return jnp.mean((out - b["y"]) ** 2)

    def stage3_loss(p, b):
        x = b["x"]
        for i, layer in enumerate(model.layers):
            x = jnp.tanh(zf.nnx_layer(layer)(p["layers"][i], x))
        return jnp.mean((zf.nnx_layer(model.norm)(p["norm"], x) - b["y"]) ** 2)

    state = check_stage3(params, plain_loss, stage3_loss, data, layers=4)
    # The NNX step at stage 3: the model's parameters are pieces its layers gather.
    mesh, tx = make_mesh(8), zs.sharded(optax.adamw(1e-2), axis_name="data")
    optimizer = zf.nnx_optimizer(model, tx, mesh, stage=3)
    step = zf.nnx_train_step(
        lambda m, b: stage3_loss(nnx.to_pure_dict(nnx.state(m, nnx.Param)), b), mesh, stage=3
    )
    for batch in data:
        step(model, optimizer, batch)
    pieces = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for got, want in zip(jax.tree.leaves(pieces), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(got, want)  # make_train_step's, bit for bit


def test_updates_outside_the_steps_take_the_mean_gradient(rng):
    """``state.apply_gradients`` and ``optimizer.update`` outside zeroshard's steps are
    the drop-in: the gradient given is the mean, and the update is plain optax's (whole
    programs in tests/test_dropin.py)."""
    mesh, model = make_mesh(8), LinenModel()
    params = model.init(jax.random.key(0), jnp.ones((1, 7)))["params"]
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zf.linen_train_state(model.apply, params, tx, mesh)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert_trees_close(state.apply_gradients(grads=grads).params, expected, 1e-6)
    nnx_model = NNXModel(nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(nnx_model, nnx.Param))
    optimizer = zf.nnx_optimizer(nnx_model, zs.sharded(optax.sgd(0.1)), mesh)
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), nnx.state(nnx_model, nnx.Param))
    optimizer.update(nnx_model, grads)
    after = nnx.to_pure_dict(nnx.state(nnx_model, nnx.Param))
    assert_trees_close(after, jax.tree.map(lambda p: p - 0.05, before), 1e-6)


def test_nnx_bf16_compute_keeps_an_fp32_master(rng):
    data, mesh = batches(rng, 3), make_mesh(8)
    model, initial = NNXModel(nnx.Rngs(0)), NNXModel(nnx.Rngs(0))
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", reduce_dtype=jnp.float32)
    optimizer = zf.nnx_optimizer(model, tx, mesh, param_dtype=jnp.bfloat16)
    assert model.l1.kernel[...].dtype == jnp.bfloat16
    master = optimizer.opt_state.master
    assert {x.dtype for x in jax.tree.leaves(nnx.as_pure(master))} == {jnp.dtype(jnp.float32)}
    step = zf.nnx_train_step(nnx_loss, mesh)
    for batch in data:
        step(model, optimizer, batch)

    def f32_loss(params, batch):
        p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        graphdef, _ = nnx.split(initial, nnx.Param)
        rest = nnx.state(initial, nnx.Not(nnx.Param))
        return nnx_loss(nnx.merge(graphdef, nnx.State(p), rest), batch)

    params = nnx.to_pure_dict(nnx.state(initial, nnx.Param))
    expected = reference_run(f32_loss, optax.sgd(0.1), params, data, jnp.bfloat16, 8)
    assert_trees_close(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), expected),
        2**-7,
    )


class NNXBatchNormModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(7, 5, rngs=rngs)
        self.norm = nnx.BatchNorm(5, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.l1(x))


def test_nnx_running_statistics_without_sync_are_the_mean_over_devices(rng):
    """With ``sync_batch_stats=False`` each device normalises with its own rows; the
    running statistics that come back are the mean of the devices' own (not one's)."""
    batch, mesh = batches(rng, 1, size=32)[0], make_mesh(8)
    model, reference = NNXBatchNormModel(nnx.Rngs(0)), NNXBatchNormModel(nnx.Rngs(0))
    optimizer = zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.1)), mesh)
    zf.nnx_train_step(nnx_loss, mesh, sync_batch_stats=False)(model, optimizer, batch)
    per_device = []
    for rows in np.split(np.asarray(batch["x"]), 8):
        device = nnx.clone(reference)
        device(jnp.asarray(rows))  # train mode: updates its running statistics
        per_device.append(nnx.to_pure_dict(nnx.state(device, nnx.BatchStat)))
    expected = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *per_device)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), expected, 1e-6)


def test_nnx_per_device_statistics_are_refused_on_the_whole_mesh(rng):
    """A model whose own sharding call names the batch axis runs on the whole mesh,
    where BatchNorm cannot normalise with each device's rows: ``sync_batch_stats=False``
    is refused there, naming the option; the default trains."""
    batch = batches(rng, 1, size=32)[0]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def loss(model, batch):
        x = jax.sharding.reshard(batch["x"], jax.sharding.PartitionSpec("data", None))
        return jnp.mean((model(x) - batch["y"]) ** 2)

    with jax.set_mesh(mesh):
        model = NNXBatchNormModel(nnx.Rngs(0))
        optimizer = zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.1)), mesh)
        with pytest.raises(ValueError, match="sync_batch_stats=False"):
            zf.nnx_train_step(loss, mesh, sync_batch_stats=False)(model, optimizer, batch)
        metrics = zf.nnx_train_step(loss, mesh)(model, optimizer, batch)
    assert int(optimizer.step[...]) == 1 and np.isfinite(float(metrics["loss"]))
