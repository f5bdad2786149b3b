"""Stage 3: weights as 1/N pieces gathered per layer; parity, memory, collectives,
and checkpoints that move between stages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, make_mesh, reference_run
from jax.sharding import PartitionSpec as P

import zeroshard as zs

WIDTH = 64


def make_params(rng, layers=3, width=WIDTH):
    f = lambda *s: jnp.asarray(rng.normal(size=s) / s[0] ** 0.5, jnp.float32)
    return {
        "layers": [{"w": f(width, width), "b": f(width) / 10} for _ in range(layers)],
        "scale": jnp.float32(1.5),  # a scalar leaf, gathered on its own
    }


def dense(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def stage3_loss(params, batch):
    x = batch["x"]
    for p in params["layers"]:
        x = zs.layer(dense)(p, x)
    return jnp.mean((zs.gather(params["scale"]) * x - batch["y"]) ** 2)


def plain_loss(params, batch):
    x = batch["x"]
    for p in params["layers"]:
        x = dense(p, x)
    return jnp.mean((params["scale"] * x - batch["y"]) ** 2)


def data(rng, steps=3, size=32, width=WIDTH):
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(size, width), "y": f(size, width)} for _ in range(steps)]


OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.1, momentum=0.9), 1e-6),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), 1e-5),
}


@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stage3_matches_plain_optax(name, accum_steps, rng):
    make, rtol = OPTIMIZERS[name]
    params, batches = make_params(rng), data(rng)
    expected = reference_run(plain_loss, make(), params, batches)
    mesh = make_mesh(8)
    tx = zs.sharded(make(), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=3)
    step = zs.make_train_step(stage3_loss, tx, mesh, stage=3, accum_steps=accum_steps)
    for batch in batches:
        state, _ = step(state, batch)
    assert isinstance(state.params["layers"][0]["w"], zs.Piece)
    got, _ = zs.to_optax_state(state, tx)
    assert_trees_close(got, expected, rtol)
    assert step.jitted._cache_size() == 1


def test_stage3_bytes_and_collectives(rng):
    n, layers = 8, 4
    params, mesh = make_params(rng, layers), make_mesh(n)
    batch = data(rng, 1)[0]
    tx = zs.sharded(optax.adam(1e-3), axis_name="data")
    held, ring = {}, {}
    for stage, loss in ((1, plain_loss), (2, plain_loss), (3, stage3_loss)):
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        held[stage] = zs.state_bytes_per_device(state.params)
        step = zs.make_train_step(loss, tx, mesh, stage=stage)
        lowered = step.lower(state, batch)
        found = zs.lowered_collectives(lowered.as_text())
        ring[stage] = sum(c.ring_bytes for c in found if c.result_bytes > 64)
    size = sum(x.size for x in jax.tree.leaves(params))
    # Stage 3 keeps 1/N of the weights per device (plus < N padding per leaf).
    assert held[1] == 4 * size
    assert 0 <= held[3] - 4 * size / n < 4 * n * len(jax.tree.leaves(params))
    # The program JAX emits: per zs.layer, one all-gather forward and one again in the
    # rematerialised backward, and one reduce-scatter (the gather's transpose); the
    # scalar, gathered outside zs.layer, once each. (XLA's CPU compiler then merges
    # each backward gather with its forward twin: see docs/stages.md.)
    kinds = [c.kind for c in found]
    assert kinds.count("all-gather") == 2 * layers + 1
    assert kinds.count("reduce-scatter") == layers + 1
    # So stage 3 moves 1.5x the bytes of stage 1 (= of a replicated all-reduce, see
    # test_instruments.py); stage 2 without accumulation is stage 1's step.
    assert ring[2] == ring[1]
    assert ring[3] / ring[1] == pytest.approx(1.5, rel=0.01), ring


def lowered_step(rng, layers: int) -> str:
    """The stage-3 step (SGD, 8 devices) of ``layers`` layers, lowered, as text."""
    mesh, tx = make_mesh(8), zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zs.init_train_state(make_params(rng, layers), tx, mesh, stage=3)
    step = zs.make_train_step(stage3_loss, tx, mesh, stage=3)
    return step.lower(state, data(rng, 1)[0]).as_text()


def test_stage3_collectives_grow_with_layers_not_leaves(rng):
    counts = {}
    for layers in (2, 4):
        lowered = lowered_step(rng, layers)
        counts[layers] = [k for k, _ in zs.collective_dtypes(lowered)].count("all-gather")
    # Two leaves (w, b) per layer, but one gather per layer and pass.
    assert counts[4] - counts[2] == 2 * 2


def test_a_layers_gradients_leave_its_gather_concatenated_not_padded(rng):
    # A layer's leaves come out of one packed all-gather; sliced out of it, each
    # slice's transpose padded its gradient to the whole gathered buffer and the pads
    # were summed (a pad and an add per leaf, every layer). Split, the transpose is
    # one concatenate: more layers, no more pads (the one left pads the scalar).
    pads = {layers: lowered_step(rng, layers).count("stablehlo.pad ") for layers in (2, 4)}
    assert pads[4] == pads[2] <= 1, pads


@pytest.mark.parametrize("save_stage, load_stage", [(1, 3), (3, 1), (3, 3)])
def test_checkpoints_move_between_stages_and_device_counts(save_stage, load_stage, rng, tmp_path):
    params, batches = make_params(rng), data(rng, 4)
    loss = {1: plain_loss, 3: stage3_loss}
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    mesh8, mesh4 = make_mesh(8), make_mesh(4)
    state = zs.init_train_state(params, tx, mesh8, stage=save_stage)
    step = zs.make_train_step(loss[save_stage], tx, mesh8, stage=save_stage)
    for batch in batches[:2]:
        state, _ = step(state, batch)
    with zs.CheckpointManager(tmp_path, tx) as ckpt:
        ckpt.save(state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(mesh4, like=params, stage=load_stage)
    step4 = zs.make_train_step(loss[load_stage], tx, mesh4, stage=load_stage)
    for batch in batches[2:]:
        restored, _ = step4(restored, batch)
    expected = reference_run(plain_loss, optax.adamw(1e-2), params, batches)
    assert_trees_close(zs.to_optax_state(restored, tx)[0], expected, 1e-5)


def test_using_a_piece_without_gathering_is_a_clear_error(rng):
    params, mesh = make_params(rng), make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=3)
    step = zs.make_train_step(plain_loss, tx, mesh, stage=3)
    with pytest.raises(TypeError, match=r"call zs.gather"):
        step(state, data(rng, 1)[0])
    with pytest.raises(ValueError, match="stage-1 step, but the state's params are pieces"):
        zs.make_train_step(plain_loss, tx, mesh)(state, data(rng, 1)[0])


def test_stage3_keeps_no_full_copy_of_the_weights(rng):
    """Per added layer, stage 1 takes the layer's full weights as arguments and stage 3
    only its 1/N piece; stage 3's temporaries hold neither a layer's gathered weights
    nor its full gradient beyond that layer's turn, so they grow by less than half a
    layer."""
    n, width, mesh = 8, 256, make_mesh(8)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data")
    layer_bytes = 4 * (width * width + width)
    memory = {}
    for layers in (4, 8):
        params = {
            "layers": [
                {"w": jnp.ones((width, width)) / width, "b": jnp.zeros(width)}
                for _ in range(layers)
            ],
            "scale": jnp.float32(1),
        }
        for stage, loss in ((1, plain_loss), (3, stage3_loss)):
            state = zs.init_train_state(params, tx, mesh, stage=stage)
            step = zs.make_train_step(loss, tx, mesh, stage=stage)
            batch = {"x": jnp.ones((n, width)), "y": jnp.zeros((n, width))}
            stats = step.lower(state, batch).compile().memory_analysis()
            memory[stage, layers] = (stats.argument_size_in_bytes, stats.temp_size_in_bytes)
    temp_per_layer = (memory[3, 8][1] - memory[3, 4][1]) / 4
    assert temp_per_layer < 0.5 * layer_bytes, temp_per_layer
    # Arguments: replicated weights in stage 1, 1/N pieces in stage 3.
    args_per_layer = {s: (memory[s, 8][0] - memory[s, 4][0]) / 4 for s in (1, 3)}
    assert args_per_layer[3] < args_per_layer[1] - layer_bytes * (1 - 1 / n) * 0.9


def test_gather_and_layer_take_the_axis_of_the_step(rng):
    """Without ``axis_name``, zs.gather and zs.layer gather over the axis of the step
    whose loss calls them (here "batch"): the same run, bit for bit, as with the axis
    named; outside any zeroshard step they gather the pieces as in the user's jit."""
    params, batches, mesh = make_params(rng), data(rng, 2), make_mesh(8, "batch")
    tx = zs.sharded(optax.adamw(1e-2), axis_name="batch")

    def named_loss(params, batch):
        x = batch["x"]
        for p in params["layers"]:
            x = zs.layer(dense, axis_name="batch")(p, x)
        return jnp.mean((zs.gather(params["scale"], axis_name="batch") * x - batch["y"]) ** 2)

    runs = []
    for loss in (stage3_loss, named_loss):
        state = zs.init_train_state(params, tx, mesh, stage=3)
        step = zs.make_train_step(loss, tx, mesh, stage=3, accum_steps=2)
        for batch in batches:
            state, metrics = step(state, batch)
        runs.append((zs.to_optax_state(state, tx)[0], metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, *runs)
    # In the user's own shard_map, manual over one axis, that axis is the default.
    shard = state.params["scale"]
    specs = (jax.tree.map(lambda x: x.sharding.spec, shard),)
    mapped = lambda f: jax.jit(
        jax.shard_map(lambda p: f(p)[None], mesh=mesh, in_specs=specs, out_specs=P("batch"))
    )
    whole = mapped(zs.gather)(shard)  # every device's gathered leaf, one row each
    assert whole.shape[0] == 8 and whole.shape[1:] == shard.shape, (whole.shape, shard.shape)
    np.testing.assert_array_equal(whole, mapped(lambda p: zs.gather(p, axis_name="batch"))(shard))
    # Outside any step (the pieces are the drop-in's stage-3 weights too) they gather
    # the weights from the pieces, as in the user's own jax.jit.
    np.testing.assert_array_equal(zs.gather(state.params["scale"]), runs[-1][0]["scale"])
    layer = zs.layer(dense)(state.params["layers"][0], batches[0]["x"])
    whole = jax.tree.map(np.asarray, runs[-1][0]["layers"][0])
    np.testing.assert_allclose(layer, dense(whole, batches[0]["x"]), rtol=1e-6)


def test_stage3_state_from_parameters_split_over_the_devices(rng):
    """``init_train_state(stage=3)`` lays the pieces out leaf by leaf from parameters in
    any placement: from leaves split over the mesh it gives the same state, bit for
    bit, as from the parameters whole."""
    mesh, tx = make_mesh(8), zs.sharded(optax.adamw(1e-2), axis_name="data")
    params = make_params(rng, layers=2)
    split = lambda x: jax.sharding.NamedSharding(mesh, P("data") if x.ndim else P())
    spread = jax.device_put(params, jax.tree.map(split, params))
    states = [zs.init_train_state(p, tx, mesh, stage=3) for p in (params, spread)]
    same = [zs.to_optax_state(s, tx) for s in states]
    jax.tree.map(np.testing.assert_array_equal, *same)
