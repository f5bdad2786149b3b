"""Stages 2 and 3 in the user's own ``jax.jit``: ``zs.sharded(inner, stage=...)``, ``zs.layer``.

The program is a stacked (scan-over-layers) model with an embedding and a head, trained
by the user's own jitted step on 8 devices (Auto axes, the batch split over ``"data"``).
Its only changes from plain optax: the optimizer line, ``tx.shard_params`` once on the
starting weights, and ``zs.layer`` around the scan body. The reference is plain optax
on one device on the global batch.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_close, stage3_bytes
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
import zeroshard.flax as zf
from zeroshard.checkpointing import ShardedRestore, ShardedSave
from zeroshard.core.lowbit import Codes

WIDTH, VOCAB = 64, 32
SCATTERED = functools.partial(zs.layers, reduce_scatter=True)
SCATTERED_ONE = functools.partial(zs.layer, reduce_scatter=True)


def gathered(fn):
    """``fn`` with its weights gathered by zs.gather (kept for the backward pass)."""
    return lambda w, x: fn(zs.gather(w), x)


def auto_mesh(shape=(8,), names=("data",), **kwargs):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), **kwargs)


def make_params(layers, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, *shape: jax.random.normal(key, shape) * shape[-2] ** -0.5
    return {
        "embed": normal(k[0], VOCAB, WIDTH),
        "blocks": {"w": normal(k[1], layers, WIDTH, WIDTH), "b": jnp.zeros((layers, WIDTH))},
        "head": normal(k[2], WIDTH, VOCAB),
    }


def make_loss(layer, outer=lambda f: f, unroll=1):
    """The model as written; ``layer`` wraps the scan body (``zs.layer``, or nothing;
    ``zs.layers``: the whole scan), ``outer`` the embedding and the head."""
    embed = outer(lambda w, tokens: jax.nn.one_hot(tokens, VOCAB) @ w)
    head = outer(lambda w, x: x @ w)

    def loss(params, batch):
        x = embed(params["embed"], batch["tokens"])
        if "odd" in params:  # (leaves the devices cannot cut along their first dimension)
            odd = zs.gather(params["odd"])
            x = x * odd["a"].sum(0) + jnp.mean(odd["b"])
        block = layer(lambda w, x: x + jnp.tanh(x @ w["w"] + w["b"]))
        if isinstance(params["blocks"], list):  # (a Python loop over the blocks)
            for w in params["blocks"]:
                x = block(w, x)
        elif getattr(layer, "func", layer) is zs.layers:
            x = block(params["blocks"], x)
        else:
            x, _ = jax.lax.scan(
                lambda x, w: (block(w, x), None), x, params["blocks"], unroll=unroll
            )
        logits = head(params["head"], x)
        return optax.losses.softmax_cross_entropy_with_integer_labels(
            logits, batch["targets"]
        ).mean()

    return loss


def batches(steps, seed=1):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (steps, 16, 9), dtype=np.int32)
    return [{"tokens": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def reference(inner, params, data, state=None):
    loss, state, losses = make_loss(lambda f: f), state or inner.init(params), []
    for batch in data:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = inner.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return params, losses


def dropin(
    tx,
    mesh,
    params,
    data,
    opt_state=None,
    shard=None,
    layer=zs.layer,
    outer=None,
    placed=True,
    rows="data",
    value_and_grad=jax.value_and_grad,
):
    """The user's own loop: jitted step, weights laid out once with tx.shard_params
    (``shard``'s: the zs.sharded of an optimizer that wraps it; not ``placed``: left
    on no mesh, as jax made them), from ``opt_state`` (default: ``tx.init``);
    ``layer`` marks the scan (``zs.layer``, ``zs.layers``), ``outer`` the embedding
    and the head; the batch's rows split over the mesh axes ``rows``; the gradient
    by ``value_and_grad`` (``jax.value_and_grad``, or ``tx.value_and_grad``)."""
    loss, shard = make_loss(layer, outer or (lambda f: f)), shard or tx

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.set_mesh(mesh):
        if placed:
            params = shard.shard_params(params)
        opt_state, losses = tx.init(params) if opt_state is None else opt_state, []
        for batch in data:
            batch = jax.device_put(batch, NamedSharding(mesh, P(rows)))
            params, opt_state, value = step(params, opt_state, batch)
            losses.append(float(value))
    return params, opt_state, losses


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    "inner",
    [
        optax.sgd(0.5, momentum=0.9),
        optax.adam(1e-2),
        CLIP_ADAMW := optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
        optax.adafactor(1e-2, min_dim_size_to_factor=32),  # factored: owned or blocked leaves
        optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5, 0.9)), 2),
    ],
    ids=["sgd", "adam", "clip_adamw", "adafactor", "accumulated_clip_sgd"],
)
def test_stages_2_and_3_in_your_own_jit_give_plain_optax(inner, stage):
    params, data, mesh = make_params(4), batches(6), auto_mesh()
    expected, expected_losses = reference(inner, params, data)
    tx = zs.sharded(inner, stacked=["blocks"], stage=stage)
    got, opt_state, losses = dropin(tx, mesh, params, data)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    # clip_adamw: the global norm is summed over pieces, in another order than on one
    # device, and Adam amplifies the difference where a gradient is near zero. On jax
    # 0.12.1 one element of 16,384 is 2.6e-5 of its leaf's scale away (at a87a172
    # too); plain optax under GSPMD is up to 4.8e-5 from itself on one device with Adam.
    assert_trees_close(got, expected, rtol=5e-5 if inner is CLIP_ADAMW else 1e-5)
    # At stage 3 the weights are pieces: each device holds 1/8 of every leaf, cut along
    # its first dimension after the layer axis; at stage 2 they are whole. The state
    # is 1/8 per device.
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert zs.state_bytes_per_device(got) == total / (8 if stage == 3 else 1)
    assert zs.state_bytes_per_device(opt_state) <= 2 * total / 8 + 64


@pytest.mark.parametrize(
    "stage, inner, axes",
    [
        (2, optax.sgd(0.5, momentum=0.9), AxisType.Auto),
        (3, optax.sgd(0.5, momentum=0.9), AxisType.Auto),
        (3, CLIP_ADAMW, AxisType.Explicit),
    ],
    ids=["sgd-2-auto", "sgd-3-auto", "clip_adamw-3-explicit"],
)
def test_a_replica_axis_in_your_own_jit(stage, inner, axes):
    """2 replicas x 4 devices with ``replica_axis=``, the batch split over both and
    jax.grad in your own jit: plain optax's losses and weights; the state 1/4 per
    device, and at stage 3 the weights too, copied over the replicas."""
    params, data = make_params(4), batches(6)
    expected, expected_losses = reference(inner, params, data)
    mesh = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(axes,) * 2)
    tx = zs.sharded(inner, stacked=["blocks"], stage=stage, replica_axis="replica")
    got, opt_state, losses = dropin(tx, mesh, params, data, rows=("replica", "data"))
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_trees_close(got, expected, rtol=5e-5 if inner is CLIP_ADAMW else 1e-5)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    held = stage3_bytes(params, axes == AxisType.Explicit, devices=4) if stage == 3 else total
    assert zs.state_bytes_per_device(got) == held
    moments = 2 if inner is CLIP_ADAMW else 1
    assert zs.state_bytes_per_device(opt_state) <= moments * total / 4 + 64


@pytest.mark.parametrize(
    "layers, outer",
    [(zs.layers, None), (SCATTERED, None), (SCATTERED, SCATTERED_ONE)],
    ids=["prefetch", "scattered", "scattered-whole-step"],
)
@pytest.mark.parametrize(
    "stage, inner, axes",
    [
        (3, optax.sgd(0.5, momentum=0.9), AxisType.Auto),
        (3, optax.adam(1e-2), AxisType.Auto),
        (2, optax.sgd(0.5, momentum=0.9), AxisType.Auto),
        (3, optax.sgd(0.5, momentum=0.9), AxisType.Explicit),
    ],
    ids=["sgd-3", "adam-3", "sgd-2", "sgd-3-explicit"],
)
def test_prefetch_gives_plain_optax(stage, inner, axes, layers, outer):
    """zs.layers (the scan, each layer's weights gathered while the one before runs),
    with each layer's backward manual over the batch axis too (reduce_scatter=True),
    and the embedding's and the head's too (zs.layer(fn, reduce_scatter=True))."""
    params, data = make_params(4), batches(6)
    expected, expected_losses = reference(inner, params, data)
    tx = zs.sharded(inner, stacked=["blocks"], stage=stage)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axes,))
    got, _, losses = dropin(tx, mesh, params, data, layer=layers, outer=outer)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_trees_close(got, expected, rtol=1e-5)


def test_accumulation_around_the_optimizer_keeps_pieces():
    """optax.MultiSteps around the stage-3 optimizer (as nnx.Optimizer users wrap
    theirs): its accumulator is laid out as the gradients, pieces, so 1/8 per device;
    the numbers are plain optax's."""
    inner, params, data = optax.adam(1e-2), make_params(4), batches(6)
    expected, expected_losses = reference(optax.MultiSteps(inner, 2), params, data)
    tx = zs.sharded(inner, stacked=["blocks"], stage=3)
    got, opt_state, losses = dropin(optax.MultiSteps(tx, 2), auto_mesh(), params, data, shard=tx)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_trees_close(got, expected, rtol=1e-5)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert zs.state_bytes_per_device(opt_state.acc_grads) == total / 8


@pytest.mark.parametrize(
    "stage, bits, inner",
    [(2, 8, optax.adam(1e-2)), (3, 4, optax.adam(1e-2)), (3, 8, optax.sgd(0.5, 0.9))],
    ids=["stage2-8-adam", "stage3-4-adam", "stage3-8-sgd"],
)
def test_low_bit_state_trains_and_restores_on_4_devices(stage, bits, inner, tmp_path):
    """state_bits at stages 2 and 3: the moments are codes, the weights (stage 3) 1/8
    per device. The state, saved after 4 steps on 8 devices with the user's own orbax
    manager, restores on 4 as the same logical state (plain optax's form), and the
    next step there is plain optax's on one device from that decoded state (the
    tolerance of tests/test_lowbit.py, where the own step is checked so)."""
    params, data = make_params(4), batches(5)
    options = dict(stacked=["blocks"], stage=stage, state_bits=bits)
    tx = zs.sharded(inner, **options)
    mesh, four = auto_mesh(), auto_mesh((4,), devices=jax.devices()[:4])
    got, opt_state, _ = dropin(tx, mesh, params, data[:4])
    coded = lambda x: isinstance(x, Codes)  # (Adam's moments, SGD's trace)
    assert sum(map(coded, jax.tree.leaves(opt_state, is_leaf=coded))) >= 3
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert zs.state_bytes_per_device(got) == total / (8 if stage == 3 else 1)
    state = zs.TrainState(jax.device_put(4, NamedSharding(mesh, P())), got, opt_state, None)
    saved = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
    with ocp.CheckpointManager(tmp_path) as manager:
        assert manager.save(4, args=ocp.args.Composite(state=ShardedSave(state, tx)))
        manager.wait_until_finished()
    tx = zs.sharded(inner, mesh=four, **options)
    with jax.set_mesh(four):
        target = zs.TrainState(jax.device_put(0, P()), params, tx.init(params), None)
    with ocp.CheckpointManager(tmp_path) as manager:
        args = ocp.args.Composite(state=ShardedRestore(target, tx, four))
        state = manager.restore(4, args=args).state
    restored = jax.tree.map(np.asarray, zs.to_optax_state(state, tx))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    got, _, _ = dropin(tx, four, state.params, data[4:], state.opt_state)
    expected, _ = reference(inner, saved[0], data[4:], saved[1])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


def padded_params():
    """The model with two weights whose first dimension 8 does not divide ((2, 64);
    (3, 7), whose layer is not 8 equal runs either)."""
    odd = {"a": jnp.full((2, WIDTH), 0.5), "b": jnp.linspace(-1, 1, 21).reshape(3, 7)}
    return make_params(2) | {"odd": odd}


def check_padded(inner, tx, mesh, devices, **options):
    """:func:`padded_params` trained by ``dropin(..., **options)``: plain optax's losses
    and weights, each padded weight a zs.Piece of ceil(size / ``devices``) per device.
    Returns the weights."""
    params, data = padded_params(), batches(3)
    expected, expected_losses = reference(inner, params, data)
    got, opt_state, losses = dropin(tx, mesh, params, data, **options)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    step = jax.device_put(0, NamedSharding(mesh, P()))
    logical = zs.to_optax_state(zs.TrainState(step, got, opt_state, None), tx)[0]
    assert_trees_close(logical, expected, rtol=1e-5)
    assert all(isinstance(x, zs.Piece) for x in got["odd"].values())
    pieces = sum(-(-x.size // devices) for x in jax.tree.leaves(params["odd"]))
    assert zs.state_bytes_per_device(got["odd"]) == pieces * 4
    return got


@pytest.mark.parametrize("inner", [optax.sgd(0.5, momentum=0.9), optax.adam(1e-2)])
@pytest.mark.parametrize("mesh", [auto_mesh(), jax.make_mesh((8, 1), ("data", "model"))])
def test_a_leaf_the_devices_cannot_cut_is_padded(mesh, inner):
    """The weights of :func:`padded_params` are kept at stage 3 as zeroshard's step
    keeps them, their padded pieces (a zs.Piece), 1/8 per device (they were whole on
    every device): read through zs.gather, which gathers them and slices them back. The
    numbers are plain optax's, on Auto axes and on Explicit ones with a second axis of
    one device."""
    tx = zs.sharded(inner, stacked=["blocks"], stage=3)
    got = check_padded(inner, tx, mesh, 8)
    explicit = mesh.axis_types[0] == AxisType.Explicit  # (the blocks' bias: whole there)
    blocks = stage3_bytes({"blocks": got["blocks"]}, explicit)
    assert zs.state_bytes_per_device(got["blocks"]) == blocks


@pytest.mark.parametrize("grad", ["tx.value_and_grad", "jax.value_and_grad"])
@pytest.mark.parametrize("axes", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2)], ids=["2x4", "2x2x2"])
def test_a_padded_leaf_over_a_replica_axis(shape, axes, grad):
    """The padded weights of the test above on 2 replicas x 4 devices (x 2 "data" x 2
    "model"), in your own jit: plain optax's numbers, each padded weight 1/4 per
    device, with tx.value_and_grad and with jax.grad; there zs.gather reads which axis
    the pieces are copied over from their type on Explicit axes, and on Auto ones from
    the sizes: on 2 x 4 only the replica axis leaves 4 devices; on 2 x 2 x 2 each axis
    does, and the gather takes the first (it was refused: any choice is exact)."""
    inner = optax.sgd(0.5, momentum=0.9)
    names = ("replica", "data", "model")[: len(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(axes,) * len(shape))
    tx = zs.sharded(inner, stacked=["blocks"], stage=3, replica_axis="replica")
    options = {"rows": ("replica", "data"), "outer": gathered}
    if grad == "tx.value_and_grad":
        options["value_and_grad"] = tx.value_and_grad
    check_padded(inner, tx, mesh, 4, **options)


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "on-no-mesh"])
@pytest.mark.parametrize("stage", [2, 3])
def test_on_explicit_axes_too(stage, placed):
    """jax's default mesh (Explicit axes): the weights' types carry their layout, and
    the gather reshards them. Weights left on no mesh (no tx.shard_params) are placed
    by tx.init and tx.update (at stage 3 they were refused by jax's shard_map), and
    come back as pieces."""
    inner, params, data = optax.sgd(0.5, momentum=0.9), make_params(2), batches(3)
    expected, expected_losses = reference(inner, params, data)
    tx = zs.sharded(inner, stacked=["blocks"], stage=stage)
    got, _, losses = dropin(tx, jax.make_mesh((8,), ("data",)), params, data, placed=placed)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_trees_close(got, expected, rtol=1e-5)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    # (stage 3: 1/8 of each weight but the blocks' bias, whole, which model code reads
    # with the activations)
    held = stage3_bytes(params, explicit=True) if stage == 3 else total
    assert zs.state_bytes_per_device(got) == held


@pytest.mark.parametrize("bits", [None, 8])
def test_stage3_init_reads_the_pieces_never_a_whole_weight(bits):
    """tx.init from the weights laid out as pieces (bfloat16, so that the float32
    master weights are made from their values): the compiled init reads each device's
    block of every weight and holds no whole one, so a model whose weights fit no one
    device starts; the state is stage 1's, made from the whole weights (with
    ``state_bits``, its codes)."""
    mesh = auto_mesh()
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params(8))
    whole = sum(x.size * 4 for x in jax.tree.leaves(bf16))  # the weights in float32
    tx = zs.sharded(optax.adam(1e-3), stacked=["blocks"], stage=3, mesh=mesh, state_bits=bits)
    pieces = tx.shard_params(jax.eval_shape(lambda: bf16))
    memory = jax.jit(tx.init).lower(pieces).compile().memory_analysis()
    assert memory.argument_size_in_bytes == whole / 2 / 8  # (the bfloat16 pieces)
    assert memory.temp_size_in_bytes <= whole / 8, memory  # (whole weights: 11x this)
    with jax.set_mesh(mesh):
        state = tx.init(tx.shard_params(bf16))
        expected = zs.sharded(optax.adam(1e-3), stacked=["blocks"], state_bits=bits).init(bf16)
    assert jax.tree.structure(state) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_gather_gives_the_gradient_not_n_times_it():
    """The gather's backward keeps the device's piece of the cotangent that jax.grad
    reduced already; a psum_scatter there would give 8x the gradient (SGD would see
    it; Adam would not)."""
    params, batch, mesh = make_params(2), batches(1)[0], auto_mesh()
    expected = jax.grad(make_loss(lambda f: f))(params, batch)
    tx = zs.sharded(optax.sgd(0.1), stacked=["blocks"], stage=3)
    with jax.set_mesh(mesh):
        pieces = tx.shard_params(jax.device_put(params, NamedSharding(mesh, P())))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        grads = jax.jit(jax.grad(make_loss(zs.layer)))(pieces, batch)
    assert_trees_close(grads, expected, rtol=1e-5)
    assert grads["blocks"]["w"].sharding.spec == P(None, "data")


def compiled_step(layers, inner=None, loss=None, stage=3, mesh=None, unrolled=False):
    """The drop-in step of ``loss`` (default: ``zs.layer`` in the scan) at ``stage``
    compiled on abstract values for ``layers`` layers on ``mesh`` (default: 8 devices,
    Auto axes); one sequence of 8 tokens per device. ``unrolled``: the blocks a list
    (the loss loops over them), not stacked."""
    mesh, inner = mesh or auto_mesh(), inner or optax.adam(1e-3)
    tx = zs.sharded(inner, stacked=None if unrolled else ["blocks"], stage=stage, mesh=mesh)
    structs = jax.eval_shape(lambda: make_params(layers))
    if unrolled:
        blocks = structs["blocks"]
        structs["blocks"] = [jax.tree.map(lambda a: a.update(shape=a.shape[1:]), blocks)] * layers
    params = tx.shard_params(structs)
    specs = tx.state_specs(params, 8)
    on = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    opt_state = jax.tree.map(on, jax.eval_shape(tx.init, structs), specs)
    rows = jax.ShapeDtypeStruct((8, 8), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    loss = loss or make_loss(zs.layer)

    def step(params, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    batch = {"tokens": rows, "targets": rows}
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch).compile()


def test_step_memory_of_your_own_step():
    """zs.step_memory(step, ..., own_step=True) compiles the user's own step as the run
    does (weights as tx.shard_params lays them, state as tx.init): the same figures as
    that program lowered by hand; stage 3 holds less than stage 2."""
    rows = jax.ShapeDtypeStruct((8, 8), jnp.int32)
    batch, structs, peaks = {"tokens": rows, "targets": rows}, make_params(8), {}
    for stage in (1, 2, 3):
        tx = zs.sharded(optax.adam(1e-3), stacked=["blocks"], stage=stage, mesh=auto_mesh())

        def step(params, opt_state, batch, tx=tx):
            updates, opt_state = tx.update(
                jax.grad(make_loss(zs.layer))(params, batch), opt_state, params
            )
            return optax.apply_updates(params, updates), opt_state

        memory = zs.step_memory(step, tx, auto_mesh(), structs, batch, own_step=True)
        m = compiled_step(8, stage=stage).memory_analysis()
        figures = (m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes)
        assert memory[:3] == figures
        peaks[stage] = memory.peak
    assert peaks[3] < peaks[2], peaks
    with pytest.raises(ValueError, match="zeroshard's step's options"):
        zs.step_memory(step, tx, auto_mesh(), structs, batch, stage=3, own_step=True)


def test_stage3_temporaries_grow_by_pieces_not_layers():
    temp = lambda n, layer=zs.layer: (
        compiled_step(n, loss=make_loss(layer)).memory_analysis().temp_size_in_bytes
    )
    layer = (WIDTH * WIDTH + WIDTH) * 4  # one layer's full weights, float32
    # Each layer adds its saved input (8 x 64 activations per device) and its pieces
    # (1/8 of the layer: the residual and the gradient), never its whole weights.
    grown = temp(8) - temp(4)
    assert grown <= 4 * (8 * WIDTH * 4 + 2 * layer / 8), grown
    # Prefetched (zs.layers), the same; it holds the next layer's whole weights besides
    # this one's (and its gradient), not the stack's.
    assert temp(8, zs.layers) - temp(4, zs.layers) <= 4 * (8 * WIDTH * 4 + 2 * layer / 8)
    assert 0 < temp(4, zs.layers) - temp(4) <= 2 * layer
    # Gathered by zs.gather alone (no second gather in the backward pass), each
    # layer's whole weights are kept for it: a layer per layer.
    assert temp(8, gathered) - temp(4, gathered) >= 4 * layer


def test_layers_in_a_python_loop_are_gathered_again_for_the_backward_pass():
    """Blocks in a Python loop (as most Flax and Equinox models are written), each
    under zs.layer, on Auto axes, where a traced weight shows no layout: each block's
    weight is all-gathered for its forward pass and again for its backward pass, so
    none is kept whole between them. (The compiler gathered each weight once, from
    the parameter itself, and kept every block's whole until its backward pass: the
    unrolled 16-block model of benchmarks/capacity.py peaked at 5.90 bytes per
    parameter there, against 2.73 now and the own step's 2.76, jax 0.12.1.)"""
    hlo = compiled_step(8, loss=make_loss(zs.layer), unrolled=True).as_text()
    gathers = re.findall(rf"f32\[{WIDTH},{WIDTH}\]\{{1,0\}} all-gather(?:-start)?\(", hlo)
    assert len(gathers) == 2 * 8, len(gathers)


def loop_ties(hlo):
    """Per while-loop body of a compiled HLO module that has all-gathers: whether one
    of them depends on a dot (a dot or a convolution, or a fusion of one) of the body,
    or a dot on one of them."""
    computations = dict(re.findall(r"^(%\S+) [^\n]*\{\n(.*?)\n\}", hlo, re.M | re.S))
    fused = {c for c, text in computations.items() if re.search(r" (dot|convolution)\(", text)}
    ties = []
    for body in set(re.findall(r"body=(%[\w.\-]+)", hlo)):
        needs, kinds = {}, {}
        for line in computations[body].splitlines():
            name, kind, rest = re.match(r"\s*(?:ROOT )?(%\S+) = .*? ([\w\-]+)\((.*)", line).groups()
            operands = re.findall(r"%[\w.\-]+", rest)
            needs[name] = set(operands).union(*(needs.get(a, ()) for a in operands))
            called = re.search(r"calls=(%[\w.\-]+)", rest)
            is_dot = kind in ("dot", "convolution") or (called and called[1] in fused)
            kinds[name] = "dot" if is_dot else kind
        gathers, dots = (
            {n for n, k in kinds.items() if k == kind} for kind in ("all-gather", "dot")
        )
        if gathers:
            assert dots, body
            ties.append(any(needs[n] & (dots if n in gathers else gathers) for n in gathers | dots))
    return ties


def test_prefetch_gathers_the_next_layer_while_this_one_runs():
    """zs.layers: in the compiled scan bodies (the forward and the backward pass) no
    all-gather depends on a dot of the body, nor a dot on an all-gather: each
    iteration gathers the next layer's weights (backward: the layer before's) while it
    computes with those the iteration before gathered, so a backend that runs
    collectives asynchronously can issue the gather before the layer's dots. (XLA's
    CPU backend runs them synchronously, and schedules them after the first dot.)
    Under zs.layer each layer's dots wait for its own gather."""
    for layer, overlaps in ((zs.layers, True), (zs.layer, False)):
        hlo = compiled_step(4, loss=make_loss(layer)).as_text()
        assert loop_ties(hlo) == [not overlaps] * 2, layer


@pytest.mark.parametrize("axes", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_prefetch_moves_what_zs_layer_moves_and_scattered_zero3s_bytes(axes):
    """zs.layers: the same gathers forward and backward and the same gradient
    reduction as zs.layer, 2x the bytes of one all-reduce of the weights (two layers:
    each loop runs once, so the program text counts every collective). With
    reduce_scatter=True each layer's weight gradient is reduce-scattered from the
    devices' partial sums instead (the layer's backward manual over the batch axis):
    ZeRO-3's 1.5x, with the embedding and the head, gathered whole by zs.gather,
    still all-reduced and sliced (their gradients' only all-reduce). With the
    embedding and the head under zs.layer(fn, reduce_scatter=True) too, the whole
    step moves ZeRO-3's bytes: each weight gathered, gathered again where its
    gradient reads it (the embedding's one-hot product's does not: the compiler
    leaves that gather out) and its gradient reduce-scattered; no all-reduce but the
    ties' scalars (1.43x one all-reduce of the weights on Explicit axes, 1.42x on
    Auto ones, jax 0.10.2 and 0.12). On Explicit axes the blocks' bias is whole, as
    model code reads it: not gathered, its gradient all-reduced."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axes,))
    structs = jax.eval_shape(lambda: make_params(2))
    bias = structs["blocks"]["b"].size * 4 if axes == AxisType.Explicit else 0
    weights = sum(x.size * 4 for x in jax.tree.leaves(structs)) - bias  # (the cut ones)
    embed, head = structs["embed"].size * 4, structs["head"].size * 4
    losses = {layer: make_loss(layer, gathered, unroll=True) for layer in (zs.layer, zs.layers)}
    losses |= {
        SCATTERED: make_loss(SCATTERED, gathered),
        "whole": make_loss(SCATTERED, SCATTERED_ONE),
    }
    found = {}
    with jax.set_mesh(mesh):
        for key, loss in losses.items():
            hlo = compiled_step(2, optax.sgd(0.1), loss, mesh=mesh).as_text()
            found[key] = zs.compiled_collectives(hlo, 8)
    ring = {key: zs.summarize(f) for key, f in found.items()}
    total = lambda key: sum(k["ring_bytes"] for k in ring[key].values()) / (2 * 7 / 8 * weights)
    assert total(zs.layers) == pytest.approx(total(zs.layer), rel=0.01), ring
    assert total(SCATTERED) == pytest.approx(1.5 + bias / weights, rel=0.01), ring
    scattered = ring[SCATTERED]
    assert scattered["reduce-scatter"]["ring_bytes"] == 7 / 8 * (weights - embed - head), ring
    reduced = 7 / 4 * (embed + head + bias)
    assert scattered["all-reduce"]["ring_bytes"] == pytest.approx(reduced, rel=0.01)
    whole = ring["whole"]
    assert set(whole) == {"all-gather", "reduce-scatter", "all-reduce"}, whole
    assert whole["reduce-scatter"]["ring_bytes"] == 7 / 8 * weights, whole
    # (gathered again: not the embedding, whose gradient does not read it)
    again = weights - embed
    # (and the new bias, whole, all-gathered by tx.update from its pieces)
    assert whole["all-gather"]["ring_bytes"] == 7 / 8 * (weights + again + bias), whole
    # (all-reduced: the ties' 4-byte scalars, fewer bytes than the smallest gradient, a
    # layer's bias; and on Explicit axes the bias's gradient)
    reduced = sum(c.result_bytes for c in found["whole"] if c.kind == "all-reduce")
    assert bias <= reduced < bias + WIDTH * 4, whole
    assert total("whole") < 1.5, whole


def test_stage2_reduces_each_layer_in_the_backward_pass():
    """Stage 2: the weights whole (zs.layer gathers nothing), each layer's gradient
    reduced to pieces as the backward pass makes it (an all-reduce per layer, the
    scan unrolled), the new weights all-gathered: the bytes of stage 1 with the model
    unmarked."""
    ring = {}
    for stage, layer in ((1, lambda f: f), (2, zs.layer)):
        loss = make_loss(layer, unroll=True)
        found = zs.compiled_collectives(compiled_step(4, optax.sgd(0.1), loss, stage).as_text(), 8)
        ring[stage] = zs.summarize(found)
    assert ring[2]["all-reduce"]["count"] >= 4 > ring[1]["all-reduce"]["count"], ring
    total = lambda r: sum(k["ring_bytes"] for k in r.values())
    assert total(ring[2]) == pytest.approx(total(ring[1]), rel=0.01), ring


def test_what_stage3_in_your_jit_refuses():
    params = make_params(2)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        zs.sharded(optax.sgd(0.1), stage=4)
    refused = {  # (stage, option, value): what the error says
        (2, "quantize_grads", "int8"): "quantize_grads='int8'.*jax.grad reduces",
        (3, "quantize_grads", "int8"): "quantize_grads='int8'.*jax.grad reduces",
        (3, "quantize_weights", "int8"): "quantize_weights='int8'.*gathers the",
        (3, "deterministic", 8): "deterministic=8.* order that depends on the device",
    }
    for (stage, option, value), match in refused.items():
        # (laid out and made as any: tx.value_and_grad's gradient takes them; jax.grad's not)
        tx = zs.sharded(optax.sgd(0.1), stacked=["blocks"], stage=stage, **{option: value})
        with jax.set_mesh(auto_mesh()):
            placed = tx.shard_params(params)
            state = tx.init(placed)
            with pytest.raises(ValueError, match=match):
                jax.eval_shape(tx.update, placed, state, placed)
    tp = auto_mesh((2, 4), ("model", "data"))  # (the pieces are cut batch-major)
    tx = zs.sharded(optax.sgd(0.1), stacked=["blocks"], stage=3)
    for first in (tx.shard_params, tx.init):  # (whichever the user calls first)
        with jax.set_mesh(tp), pytest.raises(ValueError, match="has others before them"):
            first(params)
    scaled = SCATTERED_ONE(lambda w, x, scale: x @ w * scale)  # (a scale is no rows)
    with jax.set_mesh(auto_mesh()):
        params = tx.shard_params(params)
        loss = lambda p: scaled(p["head"], jnp.ones((8, WIDTH)), 2.0).sum()
        with pytest.raises(ValueError, match=r"argument of shape \(\).*leading dimension"):
            jax.jit(jax.grad(loss))(params)


# Flax models as written, in their own steps: nnx.Optimizer and Linen's TrainState.


# Marked on Explicit axes (the model's own sharding calls need whole weights there);
# unmarked on Auto ones, where the compiler gathers (the weights 8 devices do not cut
# too: they are zs.Piece pieces, gathered where the model reads them). Adam with
# eps=1e-3: the Linen model's gradient at blocks/Dense_0/kernel[0, 10, 9] is -7.55e-8
# (the median's magnitude 7.1e-4), and plain jax's own gradient on 8 devices differs
# there from one device's by 4e-3 of it (-7.512e-8, -7.544e-8: the batch summed in
# another order); Adam's default eps turned that into 4.4e-6 of the weight after one
# step, over 1e-5 of the leaf's scale (jax 0.12.1, flax 0.12.12). A larger eps keeps
# Adam's per-element scaling everywhere else.
FLAX_CASES = pytest.mark.parametrize(
    "inner, axes, marked",
    [
        (optax.sgd(0.1, momentum=0.9), AxisType.Explicit, True),
        (optax.adam(1e-2, eps=1e-3), AxisType.Explicit, True),
        (optax.sgd(0.1, momentum=0.9), AxisType.Auto, False),
    ],
    ids=["sgd-marked-explicit", "adam-marked-explicit", "sgd-unmarked-auto"],
)


def minigpt_run(tx, mesh, batches, marked=False):
    """The miniGPT example (the suite's port) through nnx.Optimizer in its own nnx.jit
    step, dropout off; at stage 3 its weights laid out once by tx.shard_params and,
    ``marked``, its embeddings, blocks and head gathering their own weights."""
    from flax import nnx
    from test_flax_programs import MiniGPT, gpt_loss

    with jax.set_mesh(mesh):
        model = MiniGPT(rngs=nnx.Rngs(0))
        model.eval()
        if marked:
            zf.nnx_gathered(model.token_emb, model.pos_emb, model.output_layer, axis_name="data")
            zf.nnx_gathered(*model.transformer_blocks.layers, axis_name="data")
        if getattr(tx, "config", None) is not None and tx.config.stage == 3:
            nnx.update(model, tx.shard_params(nnx.state(model, nnx.Param)))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, batch):
            (loss, _), grads = nnx.value_and_grad(gpt_loss, has_aux=True)(model, batch)
            optimizer.update(model, grads)
            return loss

        losses = [
            float(train_step(model, optimizer, jax.device_put(b, P("data")))) for b in batches
        ]
        return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def logical(tree, mesh):
    """The weights of ``tree`` whole (stage 3's pieces gathered, sliced back)."""
    with jax.set_mesh(mesh):
        return jax.tree.map(np.asarray, jax.jit(lambda t: zs.gather(t, "data"))(tree))


@FLAX_CASES
def test_minigpt_through_nnx_optimizer_at_stage3(inner, axes, marked, rng):
    """The miniGPT example at stage 3 through nnx.Optimizer gives plain optax's numbers
    (one device, the global batch), on its ("data", "model") mesh with one model
    device (two: test_minigpt_on_its_tensor_parallel_mesh_at_stage3), every weight
    1/8 per device: those that 8 does not cut along their first dimension (attention's
    (2, 8) biases, (2, 8, 16) output kernels; whole on every device before) are
    zs.Piece pieces, gathered by the marks or, unmarked, where the model reads them."""
    from test_flax_programs import token_batches

    batches = token_batches(rng)
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    expected_losses, expected = minigpt_run(inner, one, batches)  # (unmarked)
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(axes, axes))
    tx = zs.sharded(inner, stage=3)
    losses, pieces = minigpt_run(tx, mesh, batches, marked)
    got = logical(pieces, mesh)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for tree in (got, expected):  # attention's key bias has a zero gradient: rounding only
        for block in range(2):
            tree["transformer_blocks"]["layers"][block]["mha"]["key"].pop("bias")
    assert_trees_close(got, expected, rtol=1e-5)
    # 1/8 of every leaf per device (a padded one's pieces: of its padded size), but,
    # on Explicit axes, the biases and the norms' scales, whole
    assert any(isinstance(x, zs.Piece) for x in jax.tree.leaves(pieces, is_leaf=is_piece))
    held = stage3_bytes(pieces, axes == AxisType.Explicit)
    assert zs.state_bytes_per_device(pieces) == held


@pytest.mark.parametrize("inner", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2)])
def test_minigpt_on_its_tensor_parallel_mesh_at_stage3(inner, rng):
    """The miniGPT example on its (4, 2) mesh (its kernels split over "model" by its
    own annotations, Explicit axes), marked, at stage 3 through nnx.Optimizer: stage
    1's numbers, each weight's "model" block cut over "data"."""
    from test_flax_programs import token_batches

    batches, mesh = token_batches(rng), jax.make_mesh((4, 2), ("data", "model"))
    expected_losses, expected = minigpt_run(zs.sharded(inner), mesh, batches)
    losses, pieces = minigpt_run(zs.sharded(inner, stage=3), mesh, batches, marked=True)
    got = logical(pieces, mesh)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for tree in (got, expected):  # attention's key bias has a zero gradient: rounding only
        for block in range(2):
            tree["transformer_blocks"]["layers"][block]["mha"]["key"].pop("bias")
    assert_trees_close(got, expected, rtol=1e-5)
    kernel = pieces["transformer_blocks"]["layers"][0]["mlp"]["layers"][0]["kernel"]
    assert kernel.sharding.spec == P("data", "model")  # (16, 16): its own split, cut
    assert zs.state_bytes_per_device(kernel) == kernel.nbytes / 8


def test_a_marked_module_that_changes_its_state_is_refused(rng):
    from flax import nnx
    from test_flax_programs import MiniGPT, gpt_loss, token_batches

    with jax.set_mesh(jax.make_mesh((8, 1), ("data", "model"))):
        model = MiniGPT(rngs=nnx.Rngs(0))  # (training: its dropout draws)
        zf.nnx_gathered(*model.transformer_blocks.layers)
        with pytest.raises(ValueError, match="TransformerBlock's call changes its own state"):
            nnx.jit(nnx.grad(gpt_loss, has_aux=True))(model, token_batches(rng)[0])


def test_a_mark_gathers_for_the_call_and_the_model_s_own_methods():
    """zf.nnx_gathered marks a module's call, nnx.Embed's attend (a tied embedding's
    logits) and the public methods of the model's own classes (encode / decode); not
    flax's other methods, such as attention's init_cache, which makes state."""
    from flax import nnx

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.table = nnx.Param(jnp.ones((VOCAB, WIDTH)))

        def encode(self, tokens):
            return self.table[...][tokens]

        def decode(self, x):
            return x @ self.table[...].T

    rngs = nnx.Rngs(0)
    embed, tied = nnx.Embed(VOCAB, WIDTH, rngs=rngs), Tied(rngs)
    attention = nnx.MultiHeadAttention(2, WIDTH, decode=True, rngs=rngs)
    zf.nnx_gathered(embed, tied, attention)
    marked = lambda m: {n for n in vars(type(m)) if not n.startswith("_z")}
    assert {"__call__", "attend"} <= marked(embed)
    assert {"encode", "decode"} <= marked(tied)
    assert "__call__" in marked(attention) and "init_cache" not in marked(attention)
    with jax.set_mesh(auto_mesh()):  # (and one runs: the table gathered, as it was)
        tokens = jnp.arange(8) % VOCAB
        np.testing.assert_array_equal(jax.jit(tied.encode)(tokens), jnp.ones((8, WIDTH)))


def linen_run(tx, mesh, batches, marked=False):
    """A Linen model as written (``nn.scan`` over a block, a dense head) through
    flax's TrainState in its own jitted step; ``marked``: its block and head are
    zf.linen_gathered (their own names kept)."""
    import flax.linen as nn
    from flax.training import train_state

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return jnp.tanh(nn.Dense(WIDTH)(x)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            block, dense = (
                (zf.linen_gathered(Block), zf.linen_gathered(nn.Dense))
                if marked
                else (Block, nn.Dense)
            )
            scan = nn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
            )
            return dense(VOCAB, name="head")(scan(name="blocks")(x, None)[0])

    model = Model()
    with jax.set_mesh(mesh):
        params = model.init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"]
        params = jax.device_put(params, NamedSharding(mesh, P()))
        if getattr(tx, "config", None) is not None and tx.config.stage == 3:
            params = tx.shard_params(params)
        state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

        @jax.jit
        def step(state, batch):
            def loss(params):
                x = jax.nn.one_hot(batch["tokens"], WIDTH)
                logits = state.apply_fn({"params": params}, x)
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, batch["targets"]
                ).mean()

            value, grads = jax.value_and_grad(loss)(state.params)
            return state.apply_gradients(grads=grads), value

        losses = []
        for batch in batches:
            state, value = step(state, jax.device_put(batch, NamedSharding(mesh, P("data"))))
            losses.append(float(value))
    return losses, state.params


@FLAX_CASES
def test_linen_scan_through_train_state_at_stage3(inner, axes, marked):
    """A Linen nn.scan model through TrainState at stage 3 gives plain optax's numbers
    (one device, the global batch), its weights 1/8 per device."""
    data = batches(4)
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    expected_losses, expected = linen_run(inner, one, data)  # (unmarked)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axes,))
    tx = zs.sharded(inner, stacked=["blocks"], stage=3)
    losses, got = linen_run(tx, mesh, data, marked)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_trees_close(got, expected, rtol=1e-5)
    held = stage3_bytes(got, axes == AxisType.Explicit)  # (the biases: whole on Explicit)
    assert zs.state_bytes_per_device(got) == held


# Tensor parallelism: a 4 data x 2 model mesh, the user's own split over "model" kept.


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
@pytest.mark.parametrize("axes", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_fsdp_by_tensor_parallel_pieces(rng, axes, inner, stage):
    """The MLP of test_step_whole_mesh.py (w1 column-, w2 row-parallel, on Explicit
    axes its second matmul's output laid out over "data" by the model) in the user's
    own jit at stages 2 and 3: plain optax's numbers. At stage 3 every weight is 1/8
    per device: its block over "model" (the user's split, which the state's layout
    keeps where a traced weight on Auto axes shows none) cut over "data", gathered
    over "data" alone."""
    from test_step_whole_mesh import data_and_params, explicit_loss, mlp_loss, plain_run

    params, data = data_and_params(rng)
    explicit = axes == AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axes,) * 2)
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    loss = explicit_loss if explicit else mlp_loss
    tx = zs.sharded(inner, axis_name="data", stage=stage)

    @jax.jit
    def step(params, opt_state, batch):
        whole = lambda p: zs.gather(p, axis_name="data")
        value, grads = jax.value_and_grad(lambda p: loss(whole(p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.set_mesh(mesh):
        params_in = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        params_in = tx.shard_params(params_in)
        opt_state, losses = tx.init(params_in), []
        for batch in data:
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
            params_in, opt_state, value = step(params_in, opt_state, batch)
            losses.append(float(value))
    plain_losses, plain = plain_run(inner, params, data)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert_trees_close(params_in, plain, 1e-5)
    total = sum(x.nbytes for x in jax.tree.leaves(params_in))
    held = zs.state_bytes_per_device(params_in)
    assert held == (total / 8 if stage == 3 else total / 2)
    if stage == 3:
        for k, spec in {"w1": P("data", "model"), "w2": P(("model", "data"), None)}.items():
            assert params_in[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), k
    assert zs.state_bytes_per_device(opt_state) <= 2 * total / 8 + 64


# Awkward shapes: a weight of any shape is 1/N at stage 3, in your jit and in the own step.


AWKWARD_VOCAB, AWKWARD_D, AWKWARD_H = 50_257, 64, 48


def awkward_params(seed=0):
    """GPT-2's 50,257-row tied embedding and a fused (L, 3, 2, D, H) projection, its
    output (L, H, D): first dimensions that 8 devices do not divide, no stacked=."""
    k = jax.random.split(jax.random.key(seed), 3)
    d, h = AWKWARD_D, AWKWARD_H
    return {
        "embed": jax.random.normal(k[0], (AWKWARD_VOCAB, d)) * 0.02,
        "blocks": {
            "proj": jax.random.normal(k[1], (2, 3, 2, d, h)) * d**-0.5,
            "out": jax.random.normal(k[2], (2, h, d)) * h**-0.5,
        },
    }


def awkward_loss(gather):
    """The model, its weights read through ``gather`` (``zs.gather``, or nothing):
    the embedding looked up, and read transposed by the head for the logits."""

    def blocks(w, x):
        for proj, out in zip(w["proj"], w["out"], strict=True):
            x = x + jnp.tanh(jnp.einsum("td,kjdh->th", x, proj)) @ out
        return x

    def loss(params, batch):
        embed = gather(params["embed"])
        x = blocks(gather(params["blocks"]), embed[batch["tokens"]].reshape(-1, AWKWARD_D))
        logits = x @ embed.T
        targets = batch["targets"].reshape(-1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


def is_piece(x):
    return isinstance(x, zs.Piece)


def fullest_device(*trees):
    """The most bytes any one device holds of ``trees``' arrays."""
    held = {}
    for x in jax.tree.leaves(trees):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


@pytest.mark.parametrize(
    "inner, exact", [(optax.sgd(0.1, momentum=0.9), True), (optax.adam(1e-3), False)]
)
def test_awkward_shapes_are_one_nth_at_stage3(inner, exact):
    """Stage 3 on 8 devices with a 50,257-row tied embedding read transposed by the
    head and a (2, 3, 2, 64, 48) projection (no stacked=): each weight padded once to
    a multiple of the devices, so the fullest device holds <= 1.02x (weights + plain
    optax's state) / 8, through the drop-in in the user's own jax.jit and through
    zeroshard's own step; the losses are plain optax's on one device (SGD: the
    weights to 1e-5)."""
    params, mesh = awkward_params(), auto_mesh()
    tokens = np.random.default_rng(3).integers(0, AWKWARD_VOCAB, (3, 16, 5), dtype=np.int32)
    data = [{"tokens": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    plain, losses = params, []
    state = inner.init(plain)
    plain_bytes = sum(x.nbytes for x in jax.tree.leaves((params, state)))
    for batch in data:
        value, grads = jax.value_and_grad(awkward_loss(lambda w: w))(plain, batch)
        updates, state = inner.update(grads, state, plain)
        plain, losses = optax.apply_updates(plain, updates), [*losses, float(value)]
    tx = zs.sharded(inner, stage=3)
    got = {}

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(awkward_loss(zs.gather))(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.set_mesh(mesh):
        weights = tx.shard_params(params)
        opt_state, values = tx.init(weights), []
        for batch in data:
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
            weights, opt_state, value = step(weights, opt_state, batch)
            values.append(float(value))
        got["drop-in"] = (values, fullest_device(weights, opt_state) / (plain_bytes / 8))
        step0 = jax.device_put(0, NamedSharding(mesh, P()))
        final = zs.to_optax_state(zs.TrainState(step0, weights, opt_state, None), tx)[0]
    state = zs.init_train_state(params, tx, mesh, axis_name="data", stage=3)
    train = zs.make_train_step(awkward_loss(zs.gather), tx, mesh, axis_name="data", stage=3)
    values = []
    for batch in data:
        state, metrics = train(state, batch)
        values.append(float(metrics["loss"]))
    got["own step"] = (values, fullest_device(state.params, state.opt_state) / (plain_bytes / 8))
    own = zs.to_optax_state(state, tx)[0]
    print(f"\nplain optax losses {losses}")
    for entry, (values, ratio) in got.items():
        print(f"{entry}: fullest device {ratio:.4f}x (weights + state) / 8, losses {values}")
        assert ratio <= 1.02, (entry, ratio)
        assert values == pytest.approx(losses, rel=1e-5 if exact else 1e-4), entry
    if exact:
        assert_trees_close(final, plain, rtol=1e-5)
        assert_trees_close(own, plain, rtol=1e-5)
