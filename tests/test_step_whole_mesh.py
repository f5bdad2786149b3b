"""make_train_step on a loss written for jax.jit on an Explicit mesh, whose own
sharding calls name the batch axis: it runs on the whole mesh, with plain optax's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, per_device_bytes
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_every_axis import EXPLICIT, Net, nnx_losses

import zeroshard as zs
import zeroshard.flax as zf


def mlp_loss(params, batch, out_sharding=None):
    """A 4 data x 2 model MLP as written for jax.jit: w1 column-, w2 row-parallel, the
    second matmul's output laid out over the batch axis by the model itself."""
    h = jnp.tanh(batch["x"] @ params["w1"])
    out = jnp.dot(h, params["w2"], out_sharding=out_sharding)
    return jnp.mean((out - batch["y"]) ** 2)


def explicit_loss(params, batch):
    return mlp_loss(params, batch, out_sharding=P("data", None))


def gathering(params, batch):
    return explicit_loss(zs.gather(params), batch)


def data_and_params(rng):
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(32, 8)) / 6, jnp.float32),
    }
    data = [
        {
            "x": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
        }
        for _ in range(6)
    ]
    return params, data


def plain_run(inner, params, data):
    """Plain optax on one device on the global batch: losses and weights."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = inner.init(params), []
    for batch in data:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params


def train(loss, tx, mesh, laid, data, stage):
    """make_train_step's run from the weights ``laid``: the last state and metrics, and
    every step's loss."""
    with jax.set_mesh(mesh):
        state = zs.init_train_state(laid, tx, mesh, stage=stage)
        step = zs.make_train_step(loss, tx, mesh, stage=stage)
        losses = []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return state, metrics, losses


SCALED = {"loss_scale": zs.DynamicLossScale(2.0**10)}


@pytest.mark.parametrize(
    "stage, inner, options",
    [(s, i, {}) for s in (1, 2, 3) for i in ("sgd", "adam")]
    + [(1, "sgd", SCALED), (3, "sgd", SCALED)],
    ids=lambda x: "scaled" if x is SCALED else "unscaled" if x == {} else None,
)
def test_an_explicit_mesh_loss_trains_in_the_own_step(rng, stage, inner, options):
    """Plain optax's numbers at every stage, with dynamic loss scaling too (the
    metrics' loss unscaled, the scale unchanged: no step overflowed)."""
    params, data = data_and_params(rng)
    inner = optax.sgd(0.1) if inner == "sgd" else optax.adam(1e-2)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    laid = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    tx = zs.sharded(inner, axis_name="data", **options)
    loss = gathering if stage == 3 else explicit_loss  # (stage 3 reads pieces so)
    state, metrics, losses = train(loss, tx, mesh, laid, data, stage)
    plain_losses, plain = plain_run(inner, params, data)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    if options:
        assert float(metrics["loss_scale"]) == 2.0**10
    # The weights keep their tensor-parallel layout (at stage 3 as 1/8 pieces of
    # its blocks); the state is 1/8 per device.
    if stage == 3:
        kept = jax.tree.leaves(state.params)
        assert all(x.addressable_shards[0].data.size * 8 == x.size for x in kept)
        assert state.params["w1"].piece.sharding.spec == P("model", "data")
    else:
        assert state.params["w1"].sharding.spec == P(None, "model")
    assert_trees_close(zs.to_optax_state(state, tx)[0], plain, 1e-5)
    moments = [x for x in jax.tree.leaves(state.opt_state.inner_state) if x.ndim]
    assert all(x.addressable_shards[0].data.size * 8 == x.size for x in moments)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_replica_axis_on_the_whole_mesh(rng, stage):
    """2 replicas x 2 data x 2 model with ``replica_axis=``, the loss's own sharding call
    naming both batch axes: the step runs it on the whole mesh, with plain optax's
    numbers (at stage 3 its pieces, copied over the replicas, each device's own)."""
    params, data = data_and_params(rng)
    axes = ("replica", "data", "model")
    mesh = jax.make_mesh((2, 2, 2), axes, axis_types=(AxisType.Explicit,) * 3)
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    laid = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", replica_axis="replica")
    read = zs.gather if stage == 3 else lambda p: p
    loss = lambda p, b: mlp_loss(read(p), b, out_sharding=P(("replica", "data"), None))
    state, _, losses = train(loss, tx, mesh, laid, data, stage)
    plain_losses, plain = plain_run(optax.sgd(0.1), params, data)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert_trees_close(zs.to_optax_state(state, tx)[0], plain, 1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_whole_mesh_step_lowers_abstract_values_as_it_runs(rng, stage):
    """zs.step_memory lowers the step on abstract values (jax.ShapeDtypeStruct): on the
    whole mesh their rows are split over the batch axis as the arrays' are in a call,
    not whole on every device, so it compiles the program that runs."""
    params, data = data_and_params(rng)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    tx = zs.sharded(optax.adam(1e-2), axis_name="data")
    loss = gathering if stage == 3 else explicit_loss
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), data[0])
    with jax.set_mesh(mesh):
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(loss, tx, mesh, stage=stage)
        compiled = [step.lower(state, batch).compile() for batch in (data[0], abstract)]
    rows = [jax.tree.leaves(c.input_shardings[0][1]) for c in compiled]
    assert [x.spec for x in rows[1]] == [P("data")] * 2 == [x.spec for x in rows[0]]
    memory = [c.memory_analysis() for c in compiled]
    assert memory[1].temp_size_in_bytes == memory[0].temp_size_in_bytes


def test_the_nnx_step_runs_an_explicit_mesh_model_at_stage_3(rng):
    """The NNX step at stage 3 on a Gemma-like model whose reshard / out_sharding calls
    name the batch axis "fsdp" (tests/test_every_axis.py), its blocks read through
    zf.nnx_layer: plain optax's losses and weights, weights and state 1/8 per device."""
    data = [tuple(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) for _ in range(2))]
    data *= 3
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=EXPLICIT)
    plain_losses, plain, _ = nnx_losses(lambda: optax.adamw(1e-2), mesh, data)

    def loss(model, batch):
        params, x = nnx.to_pure_dict(nnx.state(model, nnx.Param)), batch[0]
        for i, block in enumerate(model.blocks):
            x = zf.nnx_layer(block)(params["blocks"][i], x)
        return jnp.mean((x - batch[1]) ** 2)

    tx = zs.sharded(optax.adamw(1e-2), axis_name="fsdp")
    with jax.set_mesh(mesh):
        model = Net(rngs=nnx.Rngs(0))
        optimizer = zf.nnx_optimizer(model, tx, mesh, stage=3)
        step = zf.nnx_train_step(loss, mesh, stage=3)
        losses = [float(step(model, optimizer, batch)["loss"]) for batch in data]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    pieces = nnx.as_pure(nnx.state(model, nnx.Param))
    state = zs.TrainState(optimizer.step[...], pieces, nnx.as_pure(optimizer.opt_state))
    assert_trees_close(zs.to_optax_state(state, tx)[0], plain, 1e-5)
    total = 3 * sum(x.nbytes for x in jax.tree.leaves(plain))  # (weights, mu, nu)
    held = per_device_bytes((state.params, state.opt_state))
    assert max(held.values()) <= 1.10 * total / 8


def test_what_the_whole_mesh_step_cannot_run_is_refused_naming_the_option(rng):
    """Quantized collectives at stage 3 (whose loss reads pieces through zs.gather),
    micro-batches, a fixed order of sums and quantized gradients (jax.grad reduces
    them there): the loss's error, with a note naming the option."""
    params, data = data_and_params(rng)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    fixed = zs.sharded(optax.sgd(0.1), axis_name="data", deterministic=8)
    reduced_int8 = zs.sharded(optax.sgd(0.1), axis_name="data", quantize_grads="int8")
    quantized = zs.sharded(optax.sgd(0.1), axis_name="data", quantize_weights="int8")
    explicit = (AxisType.Explicit,) * 2
    cases = [
        ((4, 2), quantized, 3, 1, gathering, "quantize_weights"),
        ((4, 2), tx, 1, 2, explicit_loss, "accum_steps=2"),
        ((4, 2), fixed, 2, 1, explicit_loss, "deterministic"),
        ((4, 2), reduced_int8, 1, 1, explicit_loss, "quantize_grads"),
    ]
    for shape, tx, stage, accum_steps, loss, option in cases:
        mesh = jax.make_mesh(shape, ("data", "model"), axis_types=explicit)
        with jax.set_mesh(mesh):
            state = zs.init_train_state(params, tx, mesh, stage=stage)
            step = zs.make_train_step(loss, tx, mesh, stage=stage, accum_steps=accum_steps)
            with pytest.raises(ValueError, match="cannot contain axis names") as refused:
                step(state, data[0])
        assert any(option in note for note in refused.value.__notes__)
