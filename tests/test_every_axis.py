"""Every mesh axis: the one-line drop-in keeps 1/N_devices of the state on any mesh.

Where ``tx.update`` takes the mean gradient (the user's own ``jax.jit``), the gradient
is reduced already and the same on every device, so the state is split over every axis
of the mesh but the replica axis, whatever the parameters' own layout over it (tensor
parallelism, FSDP); the parameters keep that layout. The reference is plain optax on
one device on the global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization
from helpers import (
    assert_trees_close,
    awkward_loss,
    awkward_params,
    batches,
    per_device_bytes,
    reference_run,
)
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import zeroshard as zs
import zeroshard.flax as zf
from zeroshard.checkpointing import ShardedRestore, ShardedSave
from zeroshard.measuring.instruments import compiled_collectives

# A column-parallel then a row-parallel layer (Megatron's MLP) over "model", and a
# replicated bias.
TP_SPECS = {"up": P(None, "model"), "down": P("model", None), "b": P()}
EXPLICIT = (AxisType.Explicit, AxisType.Explicit)


def tp_params(rng):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
    return {"up": f(16, 64), "down": f(64, 16), "b": f(16)}


def test_clipping_and_skipping_on_a_tensor_parallel_mesh(rng):
    """Every shard counted once in the global norm: on 4 data x 2 model with the weights
    column/row-parallel, clip_by_global_norm gives plain optax's numbers through the
    step and through the drop-in, and the step's grad_norm is the global batch's; a
    non-finite gradient skips the step, leaving weights and state as they were."""
    params, data = tp_params(rng), tp_batches(rng)
    inner = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(inner)
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=2)
    step = zs.make_train_step(tp_step_loss, tx, mesh, stage=2)
    with jax.set_mesh(mesh):
        state, metrics = step(state, data[0])
        grads = jax.grad(tp_loss)(params, data[0]["x"], data[0]["y"])  # (on one device)
        np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
        assert float(optax.tree.norm(grads)) > 0.05  # (so the clipping acts)
        for batch in data[1:]:
            state, _ = step(state, batch)
        before = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
        bad = {"x": data[0]["x"].at[0, 0].set(jnp.nan), "y": data[0]["y"]}
        state, metrics = step(state, bad)
        after = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
    assert int(metrics["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    expected = reference_run(tp_step_loss, inner, params, data)
    assert_trees_close(before[0], expected, 1e-5)

    x, y = data[0]["x"], data[0]["y"]
    plain, _ = jit_loop(inner, params, (x, y))
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(auto):
        rows = NamedSharding(auto, P("data"))
        got, _ = jit_loop(
            tx, tp_placed(params, auto), (jax.device_put(x, rows), jax.device_put(y, rows))
        )
    assert_trees_close(got, plain, 1e-5)


def tp_placed(params, mesh):
    """``params`` laid out column/row-parallel over "model" (replicated over the rest)."""
    return {k: jax.device_put(v, NamedSharding(mesh, TP_SPECS[k])) for k, v in params.items()}


def tp_loss(params, x, y):
    h = jax.nn.relu(x @ params["up"])
    if jax.sharding.get_abstract_mesh().are_all_axes_explicit:  # as written for Explicit
        out = jnp.dot(h, params["down"], out_sharding=P("data", None))
    else:
        out = h @ params["down"]
    return jnp.mean((out + params["b"] - y) ** 2)


def jit_loop(tx, params, data, steps=6):
    """The user's loop: their own jitted step, plain optax's API."""

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(tp_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = first = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, *data)
    # (the state's tree, its layout included, as tx.init made it: jit traces it once)
    assert jax.tree.structure(opt_state) == jax.tree.structure(first)
    return params, opt_state


def adam_bytes(params):
    """Adam's two moments of ``params``: the state to split."""
    return 2 * sum(x.nbytes for x in jax.tree.leaves(params))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_dropin_on_a_tensor_parallel_mesh_splits_the_state_over_all_8(axis_type, rng):
    """4 data x 2 model, column/row-parallel weights, Adam: 1/8 of the state on every
    device (plain optax under GSPMD keeps 1/2: its state follows the weights' specs),
    the weights keep their "model" layout, and the numbers are plain optax's, the
    state's too (zs.to_optax_state, whether the kernels' state is held in blocks, on
    Explicit axes, or whole, on Auto ones)."""
    params = tp_params(rng)
    x, y = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(2))
    expected, expected_state = jit_loop(optax.adam(1e-2), params, (x, y))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    tx = zs.sharded(optax.adam(1e-2))
    with jax.set_mesh(mesh):
        placed = tp_placed(params, mesh)
        data = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        plain, plain_state = jit_loop(optax.adam(1e-2), placed, data)
        got, state = jit_loop(tx, placed, data)
    assert_trees_close(plain, expected, 1e-5)
    assert_trees_close(got, expected, 1e-5)
    step = jax.device_put(jnp.asarray(6, jnp.int32), NamedSharding(mesh, P()))
    logical = zs.to_optax_state(zs.TrainState(step, got, state), tx)[1]
    assert_trees_close(logical[0].mu, expected_state[0].mu, 1e-5)
    assert_trees_close(logical[0].nu, expected_state[0].nu, 1e-5)
    if axis_type == AxisType.Explicit:  # (held block by block)
        assert state.inner_state[0].mu["up"].sharding.spec == P("model", "data")
    for name, value in got.items():  # the parameters' own layout, kept
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, TP_SPECS[name]), value.ndim)
    held = per_device_bytes(state)
    assert len(held) == 8
    assert max(held.values()) <= 1.10 * adam_bytes(params) / 8
    assert max(per_device_bytes(plain_state).values()) >= adam_bytes(params) / 2


def test_the_dropin_cuts_a_tensor_parallel_gradient_within_its_shard(rng):
    """Megatron's rule in the user's own jitted step, on Explicit axes (jax's default;
    the weights' types show their layout) and on Auto ones (tx.init saw the placed
    weights, and the state carries their layout): the kernels' state is held block by
    block, their mean gradient is cut within the block (no collective), and their
    new weights are all-gathered over "data" alone; only the bias spans "model". A
    state made for replicated weights (held whole) is refused for weights laid out
    over "model", at trace time."""
    params = tp_params(rng)
    x, y = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(2))
    tx = zs.sharded(optax.adam(1e-2))

    def step(params, opt_state, x, y):
        grads = jax.grad(tp_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    moved = {}
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
        with jax.set_mesh(mesh):
            placed = tp_placed(params, mesh)
            data = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
            hlo = jax.jit(step).lower(placed, tx.init(placed), *data).compile().as_text()
        ours = [c for c in compiled_collectives(hlo, mesh=mesh) if "zeroshard/" in c.op_name]
        moved[axis_type] = {}
        for c in ours:
            key = (c.kind, c.axes)
            moved[axis_type][key] = moved[axis_type].get(key, 0) + c.result_bytes
    kernels = (16 * 64 + 64 * 16) * 4  # bytes
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        assert moved[axis_type] == {
            ("all-gather", ("data",)): kernels // 2,  # (a device's blocks)
            ("all-gather", ("data", "model")): 16 * 4,  # (the bias, whole)
            ("all-reduce", ("data", "model")): 4,  # (the gradient's global norm)
        }

    # A state made for replicated weights (held whole) is refused, at trace time.
    explicit = jax.make_mesh((4, 2), ("data", "model"), axis_types=EXPLICIT)
    with jax.set_mesh(explicit):
        whole = tx.init(params)
        placed = tp_placed(params, explicit)
        data = tuple(jax.device_put(a, NamedSharding(explicit, P("data"))) for a in (x, y))
        with pytest.raises(ValueError, match="laid out otherwise.*tx.init"):
            jax.jit(step)(placed, whole, *data)


def test_dropin_with_a_replica_axis_splits_over_the_others_only(rng):
    """2 replica x 2 data x 2 model: 1/4 of the state per device, the same on both
    replicas, exact."""
    params = tp_params(rng)
    x, y = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(2))
    expected, _ = jit_loop(optax.adam(1e-2), params, (x, y))
    mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"), axis_types=(AxisType.Auto,) * 3)
    tx = zs.sharded(optax.adam(1e-2), replica_axis="replica")
    with jax.set_mesh(mesh):
        placed = tp_placed(params, mesh)
        batch = NamedSharding(mesh, P(("replica", "data")))
        got, state = jit_loop(tx, placed, tuple(jax.device_put(a, batch) for a in (x, y)))
    assert_trees_close(got, expected, 1e-5)
    assert max(per_device_bytes(state).values()) <= 1.10 * adam_bytes(params) / 4
    moments = [x for x in jax.tree.leaves(state.inner_state) if x.size > 1]
    assert moments
    for x in moments:
        named = {a for e in x.sharding.spec if e for a in (e if isinstance(e, tuple) else (e,))}
        assert named == {"data", "model"}  # (not "replica": the replicas hold the same)
        by_device = {s.device: np.asarray(s.data) for s in x.addressable_shards}
        for coords in np.ndindex(mesh.devices.shape):
            twin = mesh.devices[(1 - coords[0], *coords[1:])]
            np.testing.assert_array_equal(by_device[mesh.devices[coords]], by_device[twin])


@pytest.mark.parametrize("bias", ["whole", "reduced"])
@pytest.mark.parametrize("read", ["as-written", "zs.layer"])
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_dropin_sums_partial_sums_over_the_replicas_too(inner, read, bias, rng):
    """Kernels typed reduced over "replica" and "data" (Explicit 2 x 2 x 2,
    tensor-parallel over "model"): their gradients arrive as partial sums over both,
    are reduce-scattered over "data" and summed over the replicas: plain optax's
    weights on one device (a mean over the replicas would halve the gradient). The
    bias typed whole and read as written (its gradient the mean already, taken as one
    device's partial sum), or typed reduced too and read through ``reshard`` (jax
    refuses it beside batch-split rows): the same. Read through ``zs.layer`` at stage
    1, the reduced weights are whole already: the same."""
    params = tp_params(rng)
    x, y = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(2))
    expected, _ = jit_loop(inner, params, (x, y), steps=3)
    names, batch = ("replica", "data", "model"), P(("replica", "data"))
    mesh = jax.make_mesh((2, 2, 2), names, axis_types=(AxisType.Explicit,) * 3)
    kind = lambda k: {"reduced": {"replica", "data"}} if k != "b" or bias == "reduced" else {}
    typed = {k: NamedSharding(mesh, s.update(**kind(k))) for k, s in TP_SPECS.items()}

    def loss(params, x, y):
        h, b = jax.nn.relu(x @ params["up"]), params["b"]
        b = reshard(b, P()) if bias == "reduced" else b
        return jnp.mean((jnp.dot(h, params["down"], out_sharding=batch) + b - y) ** 2)

    tx = zs.sharded(inner, replica_axis="replica")
    read = loss if read == "as-written" else zs.layer(loss, axis_name="data")

    @jax.jit
    def step(params, opt_state, x, y):
        updates, opt_state = tx.update(jax.grad(read)(params, x, y), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):
        got = tx.shard_params(jax.device_put(params, typed))  # (kept typed so)
        data = jax.device_put((x, y), NamedSharding(mesh, batch))
        opt_state = tx.init(got)
        for _ in range(3):
            got, opt_state = step(got, opt_state, *data)
    for k, x in got.items():  # (as they went in)
        assert x.sharding.is_equivalent_to(typed[k], x.ndim), k
        assert jax.typeof(x).sharding.spec.reduced == typed[k].spec.reduced, k
    assert_trees_close(got, expected, 1e-5)


class Block(nnx.Module):
    """A pre-norm MLP block written for an Explicit ("fsdp", "tensor") mesh, as flax's
    Gemma example shards it: kernels FSDP x tensor-parallel, the norm replicated."""

    def __init__(self, dim, rngs):
        init = nnx.initializers.lecun_normal()
        linear = lambda i, o, axes: nnx.Linear(
            i, o, use_bias=False, kernel_init=nnx.with_partitioning(init, axes), rngs=rngs
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = linear(dim, 4 * dim, ("fsdp", "tensor"))
        self.down = linear(4 * dim, dim, ("tensor", "fsdp"))

    def __call__(self, x):  # x: (batch over "fsdp", dim)
        up = reshard(self.up.kernel[...], P(None, "tensor"))  # FSDP: gathered for use
        h = jax.nn.gelu(jnp.dot(self.norm(x), up, out_sharding=P("fsdp", "tensor")))
        down = reshard(self.down.kernel[...], P("tensor", None))
        return x + jnp.dot(h, down, out_sharding=P("fsdp", None))


class Net(nnx.Module):
    def __init__(self, dim=32, rngs=None):
        self.blocks = nnx.List([Block(dim, rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def nnx_losses(make_tx, mesh, data):
    """The user's NNX loop (nnx.Optimizer in their own nnx.jit step) on ``mesh``:
    the losses, the final weights and the optimizer state."""
    with jax.set_mesh(mesh):
        model = Net(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)
            return loss

        rows = NamedSharding(mesh, P("fsdp"))
        losses = [float(step(model, optimizer, *jax.device_put(b, rows))) for b in data]
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)


def test_an_nnx_model_for_an_explicit_fsdp_tensor_mesh_through_nnx_optimizer(rng):
    """The one-line change on a model annotated with nnx.with_partitioning: the
    losses of plain optax, and 1/8 of the state on every device (plain optax's
    follows the weights: 1/8 of the kernels, the norms' scale on every device)."""
    data = [tuple(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) for _ in range(2))]
    data *= 3
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=EXPLICIT)
    plain_losses, plain, plain_state = nnx_losses(lambda: optax.adamw(1e-2), mesh, data)
    losses, got, state = nnx_losses(lambda: zs.sharded(optax.adamw(1e-2)), mesh, data)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert_trees_close(got, plain, 1e-5)
    total = adam_bytes(got)
    assert max(per_device_bytes(state).values()) <= 1.10 * total / 8
    assert max(per_device_bytes(state).values()) <= 1.10 * max(
        per_device_bytes(plain_state).values()
    )
    kernel = got["blocks"][0]["up"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", "tensor")  # the annotation, kept
    # With mesh=, as the README writes it: no axis_name needed either, the same numbers.
    tx = zs.sharded(optax.adamw(1e-2), mesh=mesh)
    with_mesh = nnx_losses(lambda: tx, mesh, data)
    assert with_mesh[0] == losses
    for a, b in zip(jax.tree.leaves(with_mesh[1:]), jax.tree.leaves((got, state)), strict=True):
        np.testing.assert_array_equal(a, b)
    # Where the axis matters (a step splits the batch over it), it is asked for.
    with pytest.raises(ValueError, match="axis_name='data' names no such axis. Pass the mesh"):
        zs.make_train_step(lambda p, b: 0.0, tx, mesh)


def test_an_nnx_model_for_an_explicit_fsdp_tensor_mesh_through_the_nnx_step(rng):
    """zeroshard.flax's NNX step on the same model: its sharding calls name the batch
    axis ("fsdp") and pass PartitionSpecs to reshard, so it cannot run per device; the
    step runs it on the whole mesh and updates as the drop-in does, at stages 1 and 2.
    The losses of plain optax, 1/8 of the state per device, the kernels kept over
    "tensor"."""
    data = [tuple(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) for _ in range(2))]
    data *= 3
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=EXPLICIT)
    plain_losses, plain, plain_state = nnx_losses(lambda: optax.adamw(1e-2), mesh, data)
    with jax.set_mesh(mesh):
        model = Net(rngs=nnx.Rngs(0))
        optimizer = zf.nnx_optimizer(model, zs.sharded(optax.adamw(1e-2), axis_name="fsdp"), mesh)

        def loss_fn(model, batch):
            out = model(batch[0])
            return jnp.mean((out - batch[1]) ** 2), out

        step = zf.nnx_train_step(loss_fn, mesh, has_aux=True)
        metrics = [step(model, optimizer, batch) for batch in data]
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], plain_losses, rtol=1e-6)
    assert metrics[0]["aux"].shape == (16, 32)  # the global batch's outputs
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert_trees_close(got, plain, 1e-5)
    state = nnx.as_pure(optimizer.opt_state)
    assert max(per_device_bytes(state).values()) <= 1.10 * adam_bytes(got) / 8
    assert max(per_device_bytes(state).values()) <= 1.10 * max(
        per_device_bytes(plain_state).values()
    )
    # Stage 1: the weights replicated over the batch axis, split over "tensor" as annotated.
    assert got["blocks"][0]["up"]["kernel"].sharding.spec == P(None, "tensor")

    # Stage 2 runs it so too; micro-batches cannot: jax's own error, with a note.
    loss = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)
    for accum_steps in (1, 2):
        with jax.set_mesh(mesh):
            model = Net(rngs=nnx.Rngs(0))
            tx = zs.sharded(optax.adamw(1e-2), axis_name="fsdp")
            optimizer = zf.nnx_optimizer(model, tx, mesh, stage=2)
            step = zf.nnx_train_step(loss, mesh, stage=2, accum_steps=accum_steps)
            if accum_steps == 1:
                losses = [float(step(model, optimizer, batch)["loss"]) for batch in data]
                np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
                assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), plain, 1e-5)
                continue
            with pytest.raises(ValueError) as refused:
                step(model, optimizer, data[0])
    assert any("accum_steps=2" in note for note in refused.value.__notes__)


def nnx_pair(mesh):
    """A fresh (model, optimizer) on ``mesh``, as a restarted job builds it."""
    with jax.set_mesh(mesh):
        model = Net(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, zs.sharded(optax.adamw(1e-2)), wrt=nnx.Param)


def nnx_train(pair, mesh, data):
    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    with jax.set_mesh(mesh):
        for batch in data:
            step(*pair, *jax.device_put(batch, NamedSharding(mesh, P("fsdp"))))
    return pair


def logical_state(pair, mesh):
    """What plain optax would hold for the pair: the same on any mesh."""
    model, optimizer = pair
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    step = jax.device_put(jnp.asarray(optimizer.step[...], jnp.int32), NamedSharding(mesh, P()))
    state = zs.TrainState(step, params, nnx.as_pure(optimizer.opt_state))
    return jax.tree.map(np.asarray, zs.to_optax_state(state, optimizer.tx))


@pytest.mark.parametrize("shape", [(8, 1), (2, 4), (1, 1)])
def test_a_checkpoint_saved_on_4x2_restores_on_another_mesh_and_continues(shape, rng, tmp_path):
    """The drop-in's state, split over all 8 devices of (4 fsdp x 2 tensor), saved
    with the user's own orbax manager and restored on (8, 1), (2, 4) and one device:
    the logical state exactly, and the next steps as the uninterrupted run's."""
    data = [tuple(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) for _ in range(2))] * 4
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=EXPLICIT)
    pair = nnx_train(nnx_pair(mesh), mesh, data[:2])
    saved = logical_state(pair, mesh)
    with ocp.CheckpointManager(tmp_path) as manager:
        assert manager.save(2, args=ocp.args.Composite(state=ShardedSave(pair)))
        manager.wait_until_finished()
    expected = nnx.to_pure_dict(nnx.state(nnx_train(pair, mesh, data[2:])[0], nnx.Param))

    devices = jax.devices()[: shape[0] * shape[1]]
    other = jax.make_mesh(shape, ("fsdp", "tensor"), axis_types=EXPLICIT, devices=devices)
    target = nnx_pair(other)
    with ocp.CheckpointManager(tmp_path) as manager:
        args = ocp.args.Composite(state=ShardedRestore(target, mesh=other))
        restored = manager.restore(2, args=args).state
    for a, b in zip(
        jax.tree.leaves(logical_state(restored, other)), jax.tree.leaves(saved), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    held = per_device_bytes(nnx.as_pure(restored[1].opt_state))
    assert len(held) == len(devices)
    got = nnx.to_pure_dict(nnx.state(nnx_train(restored, other, data[2:])[0], nnx.Param))
    assert_trees_close(got, expected, 1e-5)


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adamw(1e-2)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_over_two_data_axes(inner, stage, rng):
    """axis_name=("data", "fsdp") on jax's default (Explicit) 4 x 2 mesh: the batch and
    the state split over both, 1/8 each; the numbers are plain optax's."""
    params, data = awkward_params(rng), batches(rng, 3)
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    tx = zs.sharded(inner, axis_name=("data", "fsdp"))
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    one_axis = zs.init_train_state(params, zs.sharded(inner), jax.make_mesh((8,), ("data",)))
    assert zs.state_bytes_per_device(state.opt_state) == zs.state_bytes_per_device(
        one_axis.opt_state
    )
    loss = (lambda p, b: awkward_loss(zs.gather(p), b)) if stage == 3 else awkward_loss
    step = zs.make_train_step(loss, tx, mesh, stage=stage)
    for batch in data:
        state, _ = step(state, batch)
    full = state.params if stage < 3 else zs.to_optax_state(state, tx)[0]
    assert_trees_close(full, reference_run(awkward_loss, inner, params, data), 1e-5)


@pytest.mark.parametrize(
    "make",
    [lambda: optax.lamb(1e-2), lambda: optax.adafactor(1e-2), lambda: optax.contrib.muon(1e-2)],
    ids=["lamb", "adafactor", "muon"],
)
def test_whole_tensor_optimizers_on_tensor_parallel_leaves(make, rng):
    """Per-tensor norms (LAMB), factored moments (Adafactor) and Newton-Schulz (Muon)
    on leaves split over "model": the drop-in updates whole leaves, so the numbers are
    plain optax's on one device."""
    params = tp_params(rng)
    x, y = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(2))
    expected, _ = jit_loop(make(), params, (x, y), steps=3)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        placed = tp_placed(params, mesh)
        data = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        got, _ = jit_loop(zs.sharded(make()), placed, data, steps=3)
    assert_trees_close(got, expected, 1e-5)


def tp_step_loss(params, batch):
    """The MLP as written for tensor parallelism on jax's default (Explicit) mesh:
    column-parallel ``up``, row-parallel ``down``."""
    if jax.sharding.get_abstract_mesh().empty:  # (the one-device reference)
        return tp_loss(params, batch["x"], batch["y"])
    up = reshard(params["up"], P(None, "model"))
    down = reshard(params["down"], P("model", None))
    h = jax.nn.relu(batch["x"] @ up)
    out = jnp.dot(h, down, out_sharding=P(None, None))
    return jnp.mean((out + params["b"] - batch["y"]) ** 2)


def tp_batches(rng, steps=4):
    f = lambda: jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    return [{"x": f(), "y": f()} for _ in range(steps)]


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
@pytest.mark.parametrize("stage,accum_steps", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (3, 2)])
def test_the_step_on_a_tensor_parallel_mesh_splits_the_state_over_all_8(
    inner, stage, accum_steps, rng
):
    """zeroshard's own step on jax.make_mesh((4, 2), ("data", "model")) (the default,
    Explicit axes; refused on jax 0.12 before): the batch over "data", the loss's
    own tensor parallelism over "model", the weights kept column/row-parallel (at
    stage 3: their pieces cut within each model shard, gathered into it), and 1/8 of
    the state on every device; the numbers are plain optax's on one device."""
    params, data = tp_params(rng), tp_batches(rng)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(inner)
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=stage)
    loss = (lambda p, b: tp_step_loss(zs.gather(p), b)) if stage == 3 else tp_step_loss
    step = zs.make_train_step(loss, tx, mesh, stage=stage, accum_steps=accum_steps)
    with jax.set_mesh(mesh):
        for batch in data:
            state, _ = step(state, batch)
    full = state.params if stage < 3 else zs.to_optax_state(state, tx)[0]
    assert_trees_close(full, reference_run(tp_step_loss, inner, params, data), 1e-5)
    if stage < 3:
        assert_tp_layout(state.params, mesh, params)
    else:  # (a kernel's pieces: its model shard's, cut over "data"; the bias over all 8)
        pieces = {k: x.piece.sharding.spec for k, x in state.params.items()}
        kernel = P("model", "data")
        assert pieces == {"up": kernel, "down": kernel, "b": P(("data", "model"))}
        weights = sum(x.nbytes for x in params.values())
        assert set(per_device_bytes(state.params).values()) == {weights // 8}
    held = per_device_bytes(state.opt_state)
    assert len(held) == 8  # (+ the replicated scalars: count, grad norm, skipped steps)
    inner_state = sum(x.nbytes for x in jax.tree.leaves(zs.to_optax_state(state, tx)[1]))
    assert max(held.values()) <= 1.10 * inner_state / 8 + 64


def stage_3_style(loss):
    """``loss`` as a stage-3 loss writes it: the kernels read through zs.layer, the
    bias through zs.gather."""

    def read(params, batch):
        kernels = {k: params[k] for k in ("up", "down")}
        whole = lambda w, batch, b: loss({**w, "b": b}, batch)
        return zs.layer(whole)(kernels, batch, zs.gather(params["b"]))

    return read


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
@pytest.mark.parametrize("stage,accum_steps", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_stage_3_loss_at_stages_1_and_2_on_a_tensor_parallel_mesh(
    axis_type, inner, stage, accum_steps, rng
):
    """The stage-3 loss, unchanged, at stages 1 and 2 on 4 data x 2 model with the
    weights column/row-parallel: zs.layer and zs.gather hand it the whole weights (a
    NameError for the unbound "model" axis before), the numbers are plain optax's on
    one device, and the weights keep their layout."""
    params, data = tp_params(rng), tp_batches(rng, 3)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    plain = tp_step_loss if axis_type == AxisType.Explicit else lambda p, b: tp_loss(p, **b)
    tx = zs.sharded(inner)
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=stage)
    step = zs.make_train_step(stage_3_style(plain), tx, mesh, stage=stage, accum_steps=accum_steps)
    with jax.set_mesh(mesh):
        for batch in data:
            state, _ = step(state, batch)
    assert_trees_close(state.params, reference_run(plain, inner, params, data), 1e-5)
    assert_tp_layout(state.params, mesh, params)


def test_the_step_reduces_a_tensor_parallel_leaf_within_its_shard(rng):
    """Megatron's rule: each of the column/row-parallel kernels' state is its model
    shard's, split over the 4 data devices; zeroshard reduce-scatters their gradients
    and all-gathers their weights over "data" alone, within the shard. Only the bias,
    a vector, is reduced over every device and gathered whole."""
    params, mesh = tp_params(rng), jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(optax.adam(1e-2))
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh)
    step = zs.make_train_step(tp_step_loss, tx, mesh)
    with jax.set_mesh(mesh):
        hlo = step.lower(state, tp_batches(rng)[0]).compile().as_text()
    moved = {}
    for c in compiled_collectives(hlo, mesh=mesh):
        if "zeroshard/reduce_scatter" in c.op_name or "zeroshard/all_gather" in c.op_name:
            key = (c.kind, c.axes)
            moved[key] = moved.get(key, 0) + c.result_bytes
    kernels = (16 * 64 + 64 * 16) * 4  # bytes
    assert moved == {
        ("reduce-scatter", ("data",)): kernels // 8,  # (a device's pieces of its blocks)
        ("all-gather", ("data",)): kernels // 2,  # (its blocks)
        ("reduce-scatter", ("data", "model")): 16 * 4 // 8,
        ("all-gather", ("data", "model")): 16 * 4,
    }
    mu = state.opt_state.inner_state[0].mu
    assert mu["up"].sharding.spec == P("model", "data") == mu["down"].sharding.spec
    assert mu["up"].addressable_shards[0].data.size == 16 * 64 // 8


def test_stage_3_gathers_a_tensor_parallel_leaf_within_its_shard(rng):
    """Stage 3 on 4 data x 2 model: zs.gather brings each device the kernels' blocks of
    its model shard, all-gathered over "data" alone, and their gradients are
    reduce-scattered over "data" alone (the gather's transpose); only the bias, cut over
    all 8, is gathered over "model" too."""
    params, mesh = tp_params(rng), jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(optax.adam(1e-2))
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=3)
    step = zs.make_train_step(lambda p, b: tp_step_loss(zs.gather(p), b), tx, mesh, stage=3)
    with jax.set_mesh(mesh):
        hlo = step.lower(state, tp_batches(rng)[0]).compile().as_text()
    moved = {}
    for c in compiled_collectives(hlo, mesh=mesh):
        if "zeroshard/gather" in c.op_name:
            key = (c.kind, c.axes)
            moved[key] = moved.get(key, 0) + c.result_bytes
    kernels = (16 * 64 + 64 * 16) * 4  # bytes
    assert moved == {
        ("all-gather", ("data",)): kernels // 2 + 16 * 4,  # (its blocks; the bias)
        ("reduce-scatter", ("data",)): kernels // 8 + 16 * 4 // 4,  # (its pieces; the bias's)
        ("all-gather", ("model",)): 16 * 4 // 4,  # (the bias's pieces of one data device)
    }


def stacked_tp_loss(params, batch):
    """A scan over stacked column/row-parallel layers (residual), then a bias; at
    stage 3 each layer is gathered inside the scan by zs.layer."""
    on_mesh = "model" in jax.sharding.get_abstract_mesh().axis_names

    def block(w, x):
        if not on_mesh:  # (the one-device reference)
            return x + jax.nn.relu(x @ w["up"]) @ w["down"]
        h = jax.nn.relu(x @ reshard(w["up"], P(None, "model")))
        return x + jnp.dot(h, reshard(w["down"], P("model", None)), out_sharding=P())

    pieces = isinstance(params["b"], zs.Piece)
    layer, b = (zs.layer(block), zs.gather(params["b"])) if pieces else (block, params["b"])
    x, _ = jax.lax.scan(lambda x, w: (layer(w, x), None), batch["x"], params["blocks"])
    return jnp.mean((x + b - batch["y"]) ** 2)


def layer_muon():
    """Muon on each layer of the stacked kernels (their leading axis a batch axis)."""
    layer = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    dims = {"blocks": {"up": layer, "down": layer}, "b": None}
    return optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)


@pytest.mark.parametrize("make", [lambda: optax.adam(1e-2), layer_muon], ids=["adam", "muon"])
def test_stage_3_on_stacked_tensor_parallel_layers(make, rng):
    """Stage 3, 4 data x 2 model, three stacked column/row-parallel layers scanned over
    with zs.layer: each kernel's pieces are its model shard's layers cut over "data"
    (Muon: each layer updated whole by its owner, layer-owned), 1/8 of the state per
    device, and the numbers are plain optax's on one device."""
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
    params = {"blocks": {"up": f(3, 16, 64), "down": f(3, 64, 16)}, "b": f(16)}
    specs = {"blocks": {"up": P(None, None, "model"), "down": P(None, "model", None)}, "b": P()}
    data = tp_batches(rng, 3)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(make(), stacked=["blocks"])
    kinds = {s.path: s.placement for s in tx.plan(params, 8).layout.slots}
    kernels = "layer-owned" if make is layer_muon else "stacked"
    assert kinds == {"['b']": "sliced", "['blocks']['down']": kernels, "['blocks']['up']": kernels}
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    state = zs.init_train_state(placed, tx, mesh, stage=3)
    step = zs.make_train_step(stacked_tp_loss, tx, mesh, stage=3)
    with jax.set_mesh(mesh):
        for batch in data:
            state, _ = step(state, batch)
    full, inner_state = zs.to_optax_state(state, tx)
    assert_trees_close(full, reference_run(stacked_tp_loss, make(), params, data), 1e-5)
    held = max(per_device_bytes(state.opt_state).values())
    if make is layer_muon:  # (6 whole layers on 8 devices: as on a one-axis mesh of 8)
        one_axis = zs.init_train_state(params, tx, jax.make_mesh((8,), ("data",)), stage=3)
        assert held == max(per_device_bytes(one_axis.opt_state).values())
        return
    assert state.params["blocks"]["up"].piece.sharding.spec == P(None, "model", "data")
    assert held <= 1.10 * sum(x.nbytes for x in jax.tree.leaves(inner_state)) / 8 + 64


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deterministic_on_a_tensor_parallel_mesh(stage, rng):
    """deterministic=8 on jax's default (Explicit) N x 2 model mesh, the weights
    column/row-parallel: the state split over all 2N devices (kernels block by block),
    and the same bits on 4, 2 and 1 data devices (the model axis fixed: tensor
    parallelism's own sums are the loss's); SGD gives plain optax's numbers."""
    params, data = tp_params(rng), tp_batches(rng, 3)
    loss = (lambda p, b: tp_step_loss(zs.gather(p), b)) if stage == 3 else tp_step_loss
    inner = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
    got = {}
    for n, tx_inner in [(4, inner), (2, inner), (1, inner), (4, optax.sgd(0.1))]:
        mesh = jax.make_mesh((n, 2), ("data", "model"), devices=jax.devices()[: 2 * n])
        tx = zs.sharded(tx_inner, deterministic=8)
        state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=stage)
        step = zs.make_train_step(loss, tx, mesh, stage=stage)
        with jax.set_mesh(mesh):
            for batch in data:
                state, _ = step(state, batch)
        logical = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
        if tx_inner is inner:
            got[n] = logical
            total = sum(x.nbytes for x in jax.tree.leaves(logical[1]))
            assert max(per_device_bytes(state.opt_state).values()) <= 1.10 * total / (2 * n) + 64
    for n in (2, 1):
        for a, b in zip(jax.tree.leaves(got[n]), jax.tree.leaves(got[4]), strict=True):
            np.testing.assert_array_equal(a, b)
    expected = reference_run(tp_step_loss, optax.sgd(0.1), params, data)
    assert_trees_close(logical[0], expected, 1e-5)


def test_quantized_gradients_of_a_tensor_parallel_leaf_stay_within_its_shard(rng):
    """With int8 gradients the kernels' codes (an all_to_all per collective) go over
    "data" alone too: 4 devices' rows of a device's pieces of its blocks, one byte
    each; only the bias's small codes and scales span "model"."""
    params, mesh = tp_params(rng), jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(optax.adam(1e-2), quantize_grads="int8")
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh)
    step = zs.make_train_step(tp_step_loss, tx, mesh)
    with jax.set_mesh(mesh):
        hlo = step.lower(state, tp_batches(rng)[0]).compile().as_text()
    reduced = [
        c for c in compiled_collectives(hlo, mesh=mesh) if "zeroshard/reduce_scatter" in c.op_name
    ]
    codes = [c for c in reduced if c.dtype in ("s8", "u8")]
    assert {c.axes for c in codes if c.result_bytes >= 64} == {("data",)}
    assert sum(c.result_bytes for c in codes if c.axes == ("data",)) == 4 * (16 * 64 * 2 // 8)
    assert state.opt_state.inner_state[0].mu["up"].sharding.spec == P("model", "data")


def test_a_state_made_for_another_layout_is_refused(rng):
    """The state says how it is cut: made for replicated weights (each leaf whole) and
    then stepped with the kernels laid out over "model" (block by block), or the
    other way round, the step refuses it at trace time, naming the leaf, and the
    state is not donated. zs.to_optax_state reads a state held whole as it is (the
    drop-in's on Auto axes is), and refuses one held in blocks for weights that are
    not."""
    params, mesh = tp_params(rng), jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(optax.adam(1e-2))
    step = zs.make_train_step(tp_step_loss, tx, mesh)
    whole = zs.init_train_state(params, tx, mesh)
    blocks = zs.init_train_state(tp_placed(params, mesh), tx, mesh)
    for state, params_now in [(whole, tp_placed(params, mesh)), (blocks, whole.params)]:
        moved = state._replace(params=params_now)
        with jax.set_mesh(mesh), pytest.raises(ValueError, match="laid out otherwise"):
            step(moved, tp_batches(rng)[0])
        assert not any(x.is_deleted() for x in jax.tree.leaves(moved))
    with pytest.raises(ValueError, match="laid out otherwise"):
        zs.to_optax_state(blocks._replace(params=whole.params), tx)
    read = zs.to_optax_state(whole._replace(params=tp_placed(params, mesh)), tx)
    expected = jax.tree.leaves(zs.to_optax_state(whole, tx))
    for a, b in zip(jax.tree.leaves(read), expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_state_carries_its_layout(rng, tmp_path):
    """The optimizer state carries the layout it was made with (static: its pytree's
    aux data), and nothing reads it again from its arrays: a step's state kept block
    by block over 4 data x 2 model, moved by the user onto another layout (every
    array replicated), reads as it did, and saved with the orbax handler restores as
    it was; the step compiles once for every step (the layout is equal across
    steps); a state built without one is refused."""
    params, data = tp_params(rng), tp_batches(rng, 3)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tx, loss = zs.sharded(optax.adam(1e-2)), lambda p, b: tp_loss(p, b["x"], b["y"])
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh)
    step = zs.make_train_step(loss, tx, mesh)
    for batch in data:
        state, _ = step(state, batch)
    assert step.jitted._cache_size() == 1
    layout = state.opt_state.layout
    assert layout.axes == ("data", "model") and list(layout.by_leaf) == [1, 2]
    expected = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
    moved = jax.device_put(state.opt_state, NamedSharding(mesh, P()))
    assert moved.layout == layout  # (plain data: pickle and Flax's msgpack take it)
    assert serialization.from_bytes(moved, serialization.to_bytes(moved)).layout == layout
    read = zs.to_optax_state(state._replace(opt_state=moved), tx)
    for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(
            3, args=ocp.args.Composite(state=ShardedSave(state._replace(opt_state=moved), tx))
        )
        manager.wait_until_finished()
        restored = manager.restore(3, args=ocp.args.Composite(state=ShardedRestore(state, tx)))
    assert restored.state.opt_state.layout == layout
    read = zs.to_optax_state(restored.state, tx)
    for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="carries no layout"):
        step(state._replace(opt_state=state.opt_state._replace(layout=None)), data[0])


def assert_tp_layout(got, mesh, params):
    """The step kept the weights' tensor-parallel layout: each device holds half of
    each kernel (and the whole bias)."""
    for k, x in got.items():
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, TP_SPECS[k]), x.ndim), k
    half = (params["up"].nbytes + params["down"].nbytes) // 2
    assert set(per_device_bytes(got).values()) == {half + params["b"].nbytes}


def test_the_step_keeps_tensor_parallel_weights_on_an_auto_mesh(rng):
    """On a mesh with Auto axes, where the types carry no layout, the step still
    returns the weights laid out as they came (column/row-parallel over "model")."""
    params, data = tp_params(rng), tp_batches(rng)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    tx, loss = zs.sharded(optax.adam(1e-2)), lambda p, b: tp_loss(p, b["x"], b["y"])
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=2)
    assert_tp_layout(state.params, mesh, params)
    step = zs.make_train_step(loss, tx, mesh, stage=2)
    for batch in data:
        state, _ = step(state, batch)
    assert_trees_close(state.params, reference_run(loss, optax.adam(1e-2), params, data), 1e-5)
    assert_tp_layout(state.params, mesh, params)


def test_the_step_with_a_replica_axis_and_tensor_parallelism(rng):
    """2 replica x 2 data x 2 model: the state 1/(2 x 2) per device, the same on both
    replicas; the numbers are plain optax's."""
    params, data = tp_params(rng), tp_batches(rng)
    mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
    tx = zs.sharded(optax.adam(1e-2), replica_axis="replica")
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(tp_step_loss, tx, mesh)
    with jax.set_mesh(mesh):
        for batch in data:
            state, _ = step(state, batch)
    expected = reference_run(tp_step_loss, optax.adam(1e-2), params, data)
    assert_trees_close(state.params, expected, 1e-5)
    assert max(per_device_bytes(state.opt_state).values()) <= 1.10 * adam_bytes(params) / 4
    for x in (x for x in jax.tree.leaves(state.opt_state.inner_state) if x.size > 1):
        assert x.sharding.spec[-1] == ("data", "model")
        by_device = {s.device: np.asarray(s.data) for s in x.addressable_shards}
        for coords in np.ndindex(mesh.devices.shape):
            twin = mesh.devices[(1 - coords[0], *coords[1:])]
            np.testing.assert_array_equal(by_device[mesh.devices[coords]], by_device[twin])


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("shape", [(8, 1), (2, 4), (1, 1)])
def test_a_step_checkpoint_saved_on_4x2_restores_on_another_mesh(shape, stage, rng, tmp_path):
    """zs.CheckpointManager: a step's state split over all 8 devices of 4 data x 2
    model (at stage 3 its weights too), restored on (8, 1), (2, 4) and one device: the
    logical state exactly, the weights laid out as like's (at stage 3 cut within
    each model shard), then the same next steps as the uninterrupted run."""
    params, data = tp_params(rng), tp_batches(rng)
    tx = zs.sharded(optax.adam(1e-2))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh, stage=stage)
    loss = (lambda p, b: tp_step_loss(zs.gather(p), b)) if stage == 3 else tp_step_loss
    step = zs.make_train_step(loss, tx, mesh, stage=stage)
    with jax.set_mesh(mesh):
        for batch in data[:2]:
            state, _ = step(state, batch)
    saved = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
    with zs.CheckpointManager(tmp_path, tx) as manager:
        manager.save(state)
        manager.wait_until_finished()
        assert manager.metadata()["num_shards"] == 8  # (split over data and model)
    with jax.set_mesh(mesh):
        for batch in data[2:]:
            state, _ = step(state, batch)
    expected = jax.tree.map(np.asarray, zs.to_optax_state(state, tx)[0])

    devices = jax.devices()[: shape[0] * shape[1]]
    other = jax.make_mesh(shape, ("data", "model"), devices=devices)
    with zs.CheckpointManager(tmp_path, tx) as manager:
        restored = manager.restore(other, like=tp_placed(params, other), stage=stage)
    for k, x in restored.params.items():
        if stage < 3:
            assert x.sharding.is_equivalent_to(NamedSharding(other, TP_SPECS[k]), x.ndim), k
        elif k != "b" and shape[1] > 1:
            assert x.piece.sharding.spec == P("model", "data"), k
    got = jax.tree.map(np.asarray, zs.to_optax_state(restored, tx))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    step = zs.make_train_step(loss, tx, other, stage=stage)
    with jax.set_mesh(other):
        for batch in data[2:]:
            restored, _ = step(restored, batch)
    assert_trees_close(zs.to_optax_state(restored, tx)[0], expected, 1e-5)


def dropin_ring_bytes(inner, mesh, specs, rng):
    """Ring bytes of the collectives of the user's jitted step (``tx.update`` of
    ``inner``, plain optax or the drop-in) on ``mesh``, the weights laid out as
    ``specs``; and its weights after 3 steps."""
    params = tp_params(rng)
    x, y = (jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for _ in range(2))

    def step(params, opt_state, x, y):
        grads = jax.grad(tp_loss)(params, x, y)
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        data = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        hlo = jax.jit(step).lower(placed, inner.init(placed), *data).compile().as_text()
        got, _ = jit_loop(inner, placed, data, steps=3)
    expected, _ = jit_loop(getattr(inner, "inner", inner), params, (x, y), steps=3)
    assert_trees_close(got, expected, 1e-5)  # (plain optax on one device)
    # (the scalars left out: the gradient's global norm, 4 bytes)
    return sum(c.ring_bytes for c in compiled_collectives(hlo, mesh=mesh) if c.result_bytes > 64)


REPLICATED = {k: P() for k in TP_SPECS}
DROPIN_MESHES = {
    "explicit-tp": ((4, 2), ("data", "model"), AxisType.Explicit, TP_SPECS),
    "auto-1d": ((8,), ("data",), AxisType.Auto, REPLICATED),
    "explicit-1d": ((8,), ("data",), AxisType.Explicit, REPLICATED),
    "auto-tp": ((4, 2), ("data", "model"), AxisType.Auto, TP_SPECS),
}


DROPIN_CASES = [
    *[(c, s, False) for s in (1, 2) for c in DROPIN_MESHES],
    *[(c, s, True) for s in (1, 2) for c in ("explicit-1d", "explicit-tp")],
]


@pytest.mark.parametrize("case,stage,reduced", DROPIN_CASES)
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_the_dropins_bytes_on_the_wire(case, inner, stage, reduced, rng):
    """The user's own jitted step with the drop-in (stages 1 and 2) moves at most 1.5x
    the ring bytes of plain optax's same step (from the compiled HLO), with plain
    optax's numbers on one device: the 1.5x of a reduce-scatter + all-gather where
    XLA's CPU pipeline leaves an all-reduce before the cut. A tensor-parallel leaf's
    gradient is cut within its block on Auto axes too (the state's layout says
    which), never gathered over "model". With the weights typed ``reduced`` over
    "data" (Explicit axes), jax.grad leaves the gradient's partial sums to the update,
    which reduce-scatters them: at most 1.05x plain optax's bytes (the kernels typed
    so; the bias left whole, read as written, its gradient all-reduced as plain
    optax's)."""
    shape, names, axis_type, specs = DROPIN_MESHES[case]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    plain = dropin_ring_bytes(inner, mesh, specs, rng)
    kernels = lambda k, s: s.update(reduced={"data"}) if reduced and k != "b" else s
    typed = {k: kernels(k, s) for k, s in specs.items()}
    ours = dropin_ring_bytes(zs.sharded(inner, stage=stage), mesh, typed, rng)
    assert ours <= (1.05 if reduced else 1.5) * plain, (ours, plain)
