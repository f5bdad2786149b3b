"""Quantized collectives: the codes, one step against plain optax on the dequantized
mean gradient (built here, in numpy, from each device's local gradient), the payloads
and bytes of the compiled step, and every shape of leaf."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, layered_loss, layered_params, make_mesh

import zeroshard as zs
from zeroshard.communication.quantized import Quantizer
from zeroshard.core.update import Route
from zeroshard.measuring.scopes import scopes_of

BITS = {"int8": 8, "int4": 4}


# The reference: blockwise codes as the docs state them, in numpy.


def np_dequantized(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """A 1-D part after its trip as codes: ``ceil(w / block)`` equal blocks, each
    scaled by its largest magnitude over ``2^(bits-1) - 1`` and rounded."""
    width = x.size
    count = max(1, -(-width // block))
    size = -(-width // count)
    v = np.zeros(count * size, np.float32)
    v[:width] = x
    v = v.reshape(count, size)
    levels = np.float32(2 ** (bits - 1) - 1)
    scale = np.abs(v).max(axis=1) * np.float32(1 / levels)
    inverse = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(v * inverse[:, None]), -levels, levels)
    return (q * scale[:, None]).reshape(-1)[:width].astype(np.float32)


def np_pieces(leaf, n: int) -> np.ndarray:
    """``(n, width)``: device ``d``'s piece of the raveled, zero-padded leaf in row ``d``."""
    flat = np.asarray(jnp.asarray(leaf).astype(jnp.float32)).ravel()
    width = -(-flat.size // n)
    return np.pad(flat, (0, n * width - flat.size)).reshape(n, width)


def np_whole(pieces: np.ndarray, like) -> np.ndarray:
    return pieces.reshape(-1)[: np.size(like)].reshape(np.shape(like))


def dequantized_mean(local_grads: list, bits: int, block: int, owned=()) -> dict:
    """The mean over devices of each device's gradient after its trip as codes: every
    piece quantized by its sender (an owned leaf's gradient whole, in its owner's row)."""
    n = len(local_grads)

    def leaf_mean(path, *grads):
        if jax.tree_util.keystr(path) in owned:
            trips = [np_dequantized(np_pieces(g, 1)[0], bits, block) for g in grads]
            return np_whole(np.sum(trips, axis=0) / np.float32(n), grads[0])
        trips = [[np_dequantized(p, bits, block) for p in np_pieces(g, n)] for g in grads]
        return np_whole(np.sum(np.asarray(trips), axis=0) / np.float32(n), grads[0])

    return jax.tree_util.tree_map_with_path(leaf_mean, *local_grads)


def dequantized_weights(params, n: int, block: int):
    """The parameters every device holds after an int8 gather of their pieces."""

    def leaf(p):
        trips = np.stack([np_dequantized(x, 8, block) for x in np_pieces(p, n)])
        return jnp.asarray(np_whole(trips, p)).astype(p.dtype)

    return jax.tree.map(leaf, params)


def local_grads(params, batch, n: int, loss=awkward_loss) -> list:
    """Each device's gradient of its rows of the batch (the step's loss: their mean)."""
    parts = [jax.tree.map(lambda x, d=d: jnp.split(x, n)[d], batch) for d in range(n)]
    return [jax.tree.map(np.asarray, jax.grad(loss)(params, part)) for part in parts]


def one_step(tx, params, batch, n, stage):
    mesh = make_mesh(n)
    loss = awkward_loss if stage < 3 else lambda p, b: awkward_loss(zs.gather(p), b)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(loss, tx, mesh, stage=stage)
    return step(state, batch)[0]


def assert_close(actual, expected, what):
    """Equal but for float32 summation order: 8 ulps (2^-23 each) of the leaf's
    largest value (a second moment, the square of a sum, doubles the relative error)."""
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(np.max(np.abs(e)), 1e-30)
        np.testing.assert_allclose(a, e, rtol=0, atol=2**-20 * scale, err_msg=f"{what} {path}")


def test_codes_match_the_reference_and_bound_the_error(rng):
    """Every width (under one block, not a multiple of it, several blocks), both
    formats, bf16 and fp32 inputs: the decoded values are the reference's, and each is
    within half a step of the input."""
    block = 16
    for bits in (8, 4):
        q = Quantizer(bits, block)
        for dtype in (jnp.float32, jnp.bfloat16):
            widths = [1, 5, 16, 17, 33, 100]
            parts = [jnp.asarray(rng.normal(size=(3, w)), dtype) for w in widths]
            codes, scales = q.encode(parts)
            assert codes.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
            assert codes.size + 4 * scales.size == 3 * q.nbytes(widths)
            for x, y in zip(parts, q.decode(codes, scales, widths, jnp.float32), strict=True):
                for row, got in zip(np.asarray(x.astype(jnp.float32)), np.asarray(y), strict=True):
                    np.testing.assert_array_equal(got, np_dequantized(row, bits, block))
                    step = np.abs(row).max() / (2 ** (bits - 1) - 1)
                    assert np.all(np.abs(got - row) <= step / 2 * (1 + 1e-6))


def test_nonfinite_survives_the_codes():
    q = Quantizer(8, 4)
    x = jnp.array([[1.0, jnp.nan, 2.0, 3.0, 1.0, jnp.inf, 0.0, 0.0, 1.0]])
    (got,) = q.decode(*q.encode([x]), [9], jnp.float32)
    assert not np.all(np.isfinite(np.asarray(got)[0, :6]))
    np.testing.assert_array_equal(np.asarray(got)[0, 6:], [0.0, 0.0, 1.0])


@pytest.mark.parametrize(
    "stage,grads,weights,inner",
    [
        (1, "int8", None, "sgd"),
        (1, "int4", "int8", "sgd"),
        (1, "int8", "int8", "adamw"),
        (3, "int8", "int8", "sgd"),
        (3, "int4", None, "adamw"),
    ],
)
def test_one_step_is_optax_on_the_dequantized_mean_gradient(stage, grads, weights, inner, rng):
    """N = 8, fp32 and bf16 leaves, a scalar, 1-D leaves, sizes prime to N and to the
    block, leaves smaller than one block. The master weights and the optimizer state
    after one step are plain optax's applied to the mean of each device's dequantized
    gradient; the weights every device holds are the master's pieces dequantized."""
    n, block = 8, 8
    make = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1)}
    params, batch = awkward_params(rng, small_dtype=jnp.bfloat16), batches(rng, 1)[0]
    tx = zs.sharded(
        make[inner](), quantize_grads=grads, quantize_weights=weights, quantize_block=block
    )
    state = one_step(tx, params, batch, n, stage)

    # Stage 3 computes the gradient at the weights its gathers bring.
    at = dequantized_weights(params, n, block) if stage == 3 and weights else params
    mean = dequantized_mean(local_grads(at, batch, n), BITS[grads], block)
    if stage == 3:  # a piece's gradient has its dtype (the sum of bf16 pieces is bf16)
        mean = jax.tree.map(lambda g, p: jnp.asarray(g).astype(p.dtype), mean, params)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    mean = jax.tree.map(lambda g, m: jnp.asarray(g, m.dtype), mean, master)
    reference = make[inner]()
    updates, expected_state = reference.update(mean, reference.init(master), master)
    expected = optax.apply_updates(master, updates)

    got_master, got_state = zs.to_optax_state(state, tx)
    assert_close(got_master, expected, "master")
    assert_close(got_state, expected_state, "state")
    pairs = zip(jax.tree.leaves(expected), jax.tree.leaves(master), strict=True)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    assert moved > 1e-3
    if stage == 3:  # the pieces are the exact weights; quantized only in the gathers
        held = jax.tree.map(lambda m, p: m.astype(p.dtype), got_master, params)
        whole = lambda x: np.asarray(x.piece).ravel()[: int(np.prod(x.shape))].reshape(x.shape)
        pieces = jax.tree.map(whole, state.params, is_leaf=lambda x: isinstance(x, zs.Piece))
        for got, want in zip(jax.tree.leaves(pieces), jax.tree.leaves(held), strict=True):
            np.testing.assert_array_equal(got, np.asarray(want))
    else:
        held = jax.tree.map(lambda m, p: m.astype(p.dtype), got_master, params)
        if weights:
            held = dequantized_weights(held, n, block)
        for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(held), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            shards = [np.asarray(s.data) for s in got.addressable_shards]
            assert all(np.array_equal(s, shards[0]) for s in shards)  # every device the same


def sgd_after(params, mean, lr=0.1):
    return jax.tree.map(lambda p, g: p.astype(jnp.float32) - lr * jnp.asarray(g), params, mean)


def layers_of(tree):
    """A stacked tree's leaves as lists of their layers (each gathered on its own)."""
    return jax.tree.map(lambda x: list(np.asarray(x)), tree)


def stacked(tree):
    return jax.tree.map(np.stack, tree, is_leaf=lambda x: isinstance(x, list))


@pytest.mark.parametrize("model", ["layers", "scan"])
def test_stage3_layers_gather_and_reduce_each_layer_as_codes(model, rng):
    """zs.layer per layer, and a scan over stacked layers (one layer's pieces per
    iteration): each layer's weights arrive as codes forward and backward, and each
    layer's gradient is reduced as codes; one SGD step is the reference's."""
    n, block, width = 8, 8, 24
    batch = {"x": jnp.asarray(rng.normal(size=(16, width)), jnp.float32)}
    batch["y"] = jnp.tanh(batch["x"])
    if model == "layers":
        params, options = layered_params(rng, layers=2, width=width), {}
        loss3, split = functools.partial(layered_loss, stage=3), lambda t: t
        plain, merge = layered_loss, lambda t: t
    else:
        params = {"blocks": layered_params(rng, layers=1, width=width)["l0"]}
        params = {"blocks": jax.tree.map(lambda x: jnp.stack([x, 0.5 * x, -x]), params["blocks"])}
        options, split, merge = {"stacked": ["blocks"]}, layers_of, stacked
        dense = lambda p, x: jnp.tanh(x @ p["w"] + p["b"])

        def plain(p, b):
            x, _ = jax.lax.scan(lambda x, w: (dense(w, x), None), b["x"], p["blocks"])
            return jnp.mean((x - b["y"]) ** 2)

        def loss3(p, b):
            x, _ = jax.lax.scan(lambda x, w: (zs.layer(dense)(w, x), None), b["x"], p["blocks"])
            return jnp.mean((x - b["y"]) ** 2)

    tx = zs.sharded(
        optax.sgd(0.1),
        quantize_grads="int8",
        quantize_weights="int8",
        quantize_block=block,
        **options,
    )
    mesh = make_mesh(n)
    state = zs.init_train_state(params, tx, mesh, stage=3)
    state, _ = zs.make_train_step(loss3, tx, mesh, stage=3)(state, batch)
    at = merge(dequantized_weights(split(params), n, block))
    grads = [split(g) for g in local_grads(at, batch, n, loss=plain)]
    mean = merge(dequantized_mean(grads, 8, block))
    assert_close(zs.to_optax_state(state, tx)[0], sgd_after(params, mean), "master")


def test_owned_leaves_travel_in_their_owners_rows(rng):
    """A leaf forced owned: its gradient is reduced as one part of its owner's row."""
    n, block, owned = 8, 8, "['dense']['w']"
    params, batch = awkward_params(rng), batches(rng, 1)[0]
    force = lambda path, leaf: "owned" if path == owned else None
    tx = zs.sharded(optax.sgd(0.1), quantize_grads="int8", quantize_block=block, placement=force)
    assert any(s.owned for s in tx.plan(params, n).layout.slots)
    state = one_step(tx, params, batch, n, stage=1)
    mean = dequantized_mean(local_grads(params, batch, n), 8, block, owned={owned})
    assert_close(zs.to_optax_state(state, tx)[0], sgd_after(params, mean), "master")


def test_accumulation_quantizes_each_reduction(rng):
    """Stage 2 reduces every micro-batch (each one quantized), stage 1 the accumulated
    local gradient once."""
    n, k, block = 4, 2, 8
    params, batch = awkward_params(rng), batches(rng, 1, size=16)[0]
    tx = zs.sharded(optax.sgd(0.1), quantize_grads="int8", quantize_block=block)
    mesh = make_mesh(n)
    micro = lambda d, i: jax.tree.map(lambda x: jnp.split(jnp.split(x, n)[d], k)[i], batch)
    grads = [[jax.grad(awkward_loss)(params, micro(d, i)) for i in range(k)] for d in range(n)]
    for stage in (1, 2):
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(awkward_loss, tx, mesh, stage=stage, accum_steps=k)
        state, _ = step(state, batch)
        if stage == 1:
            local = [jax.tree.map(lambda *g: sum(g) / k, *grads[d]) for d in range(n)]
            mean = dequantized_mean([jax.tree.map(np.asarray, g) for g in local], 8, block)
        else:
            means = [
                dequantized_mean(
                    [jax.tree.map(np.asarray, grads[d][i]) for d in range(n)], 8, block
                )
                for i in range(k)
            ]
            mean = jax.tree.map(lambda *m: sum(m) / np.float32(k), *means)
        assert_close(zs.to_optax_state(state, tx)[0], sgd_after(params, mean), f"stage {stage}")


@pytest.mark.parametrize("stage", [1, 3])
def test_replica_axis_reduces_in_two_levels(stage, rng):
    """Over (replica 2, data 4): each replica reduces over its data axis as codes, then
    each piece is cut in two, the cuts reduced over the replicas as codes, and the mean
    re-quantized once and gathered."""
    r, n, block = 2, 4, 8
    params, batch = awkward_params(rng), batches(rng, 1)[0]
    mesh = jax.make_mesh((r, n), ("replica", "data"))
    tx = zs.sharded(
        optax.sgd(0.1), replica_axis="replica", quantize_grads="int8", quantize_block=block
    )
    loss = awkward_loss if stage < 3 else lambda p, b: awkward_loss(zs.gather(p), b)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    state, _ = zs.make_train_step(loss, tx, mesh, stage=stage)(state, batch)
    grads = local_grads(params, batch, r * n)  # part r * n + e on replica r, data index e

    def leaf(*gs):
        width = -(-gs[0].size // n)
        first = [  # per replica, every data index's piece of the level-one mean
            np.sum(
                [
                    [np_dequantized(p, 8, block) for p in np_pieces(g, n)]
                    for g in gs[q * n : (q + 1) * n]
                ],
                axis=0,
            )
            / np.float32(n)
            for q in range(r)
        ]
        pieces = []
        for e in range(n):
            cut = -(-width // r)
            cuts = [np.pad(first[q][e], (0, r * cut - width)).reshape(r, cut) for q in range(r)]
            sums = [
                sum(np_dequantized(c[j], 8, block) for c in cuts) / np.float32(r) for j in range(r)
            ]
            pieces.append(np.concatenate([np_dequantized(s, 8, block) for s in sums])[:width])
        return np_whole(np.stack(pieces), gs[0])

    mean = jax.tree.map(leaf, *grads)
    assert_close(zs.to_optax_state(state, tx)[0], sgd_after(params, mean), "master")


@pytest.mark.parametrize("stage", [1, 3])
def test_compiled_payloads_and_bytes(stage, rng):
    """The step's gradient and weight collectives carry s8 (int8) or u8 (packed int4)
    codes plus f32 scales, in the named scopes of their exact twins; the arrival's and
    departure's byte counts are the compiled program's; and the ring bytes shrink."""
    n = 8
    params = {"w": jnp.asarray(rng.normal(size=(64, 96)), jnp.float32), "b": jnp.zeros(96)}
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
    batch = {"x": jnp.ones((16, 64))}
    mesh = make_mesh(n)

    def compiled(**options):
        tx = zs.sharded(optax.adam(1e-3), **options)
        fn = loss if stage < 3 else lambda p, b: loss(zs.gather(p), b)
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(fn, tx, mesh, stage=stage)
        return tx, zs.compiled_collectives(step.lower(state, batch).compile().as_text())

    _, exact = compiled()
    ring = lambda found: sum(c.ring_bytes for c in found)
    for grads, codes, bound in (("int8", "s8", 0.55), ("int4", "u8", 0.40)):
        tx, found = compiled(quantize_grads=grads, quantize_weights="int8")
        moved = {(c.kind, c.dtype) for c in found if c.kind in ("all-to-all", "all-gather")}
        assert {("all-to-all", codes), ("all-gather", "s8")} <= moved
        assert ("all-to-all", "f32") in moved and ("all-gather", "f32") in moved  # scales
        assert not [c for c in found if c.kind == "reduce-scatter"]
        assert ring(found) <= bound * ring(exact)
        by_scope = lambda name, found=found: sum(
            c.result_bytes for c in found if name in scopes_of(c.op_name)
        )
        if stage == 1:
            arrival, departure = Route.of(tx.config, 1)[:2]
            plan = tx.plan(params, n)
            assert by_scope("reduce_scatter") == arrival.nbytes(plan)
            assert by_scope("all_gather") == departure.nbytes(plan)
        else:
            assert by_scope("gather") > 0


def test_a_nonfinite_gradient_still_skips_the_step(rng):
    params, batch = awkward_params(rng), batches(rng, 1)[0]
    batch["x"] = batch["x"].at[3, 2].set(jnp.inf)
    tx = zs.sharded(optax.sgd(0.1), quantize_grads="int4", quantize_weights="int8")
    mesh = make_mesh(8)
    state = zs.init_train_state(params, tx, mesh)
    state, metrics = zs.make_train_step(awkward_loss, tx, mesh)(state, batch)
    assert int(metrics["skipped"]) == 1
    # The master is unchanged; the weights every device holds are its gathered codes.
    master = zs.to_optax_state(state, tx)[0]
    held = jax.tree.leaves(dequantized_weights(params, 8, 256))
    pairs = [
        *zip(jax.tree.leaves(master), jax.tree.leaves(params), strict=True),
        *zip(jax.tree.leaves(state.params), held, strict=True),
    ]
    for got, want in pairs:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("stage", [1, 2])
def test_dropin_gathers_quantized_weights_and_says_grads_are_not(stage, rng, caplog):
    """In the user's own jit the mean gradient arrives reduced: the weights' gather is
    quantized (stage 2 too, whose update all-gathers them), the gradient is not, and
    a warning says so (stage 2 refuses quantize_grads: test_dropin_stage3.py). The
    weights are the numpy reference's, and zeroshard's own step's at the stage."""
    n, block = 8, 8
    params, batch = awkward_params(rng), batches(rng, 1)[0]
    mesh = make_mesh(n)
    tx = zs.sharded(
        optax.sgd(0.1),
        quantize_grads="int8" if stage == 1 else None,
        quantize_weights="int8",
        quantize_block=block,
        mesh=mesh,
        stage=stage,
    )

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(awkward_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with caplog.at_level("WARNING", logger="zeroshard.optimizer.sharded"), jax.set_mesh(mesh):
        new, _ = step(params, tx.init(params), batch)
    assert ("no gradient is quantized" in caplog.text) == (stage == 1)
    master = sgd_after(params, jax.grad(awkward_loss)(params, batch))
    expected = dequantized_weights(master, n, block)
    own = zs.sharded(optax.sgd(0.1), quantize_weights="int8", quantize_block=block)
    own = one_step(own, params, batch, n, stage).params
    for got, want, mine in zip(*map(jax.tree.leaves, (new, expected, own)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got), np.asarray(mine), rtol=0, atol=1e-6)


def test_bad_options_are_clear_errors():
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match="quantize_grads must be one of"):
        zs.sharded(sgd, quantize_grads="int2")
    with pytest.raises(ValueError, match="quantize_weights must be one of"):
        zs.sharded(sgd, quantize_weights="int4")
    with pytest.raises(ValueError, match="quantize_block must be an even int"):
        zs.sharded(sgd, quantize_grads="int8", quantize_block=7)
    with pytest.raises(ValueError, match="pass only one"):
        zs.sharded(sgd, quantize_grads="int8", reduce_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="needs master weights"):
        zs.sharded(sgd, quantize_weights="int8", master_dtype=None)


def test_checkpoints_hold_the_exact_master_and_restore_anywhere(rng, tmp_path):
    """The checkpoint holds the exact master and state (no codes): restored on 8
    devices the run continues bit for bit; on 4, from the same master and state."""
    params, data = awkward_params(rng), batches(rng, 2)
    tx = zs.sharded(optax.adamw(1e-2), quantize_grads="int8", quantize_weights="int8")
    state = zs.init_train_state(params, tx, make_mesh(8), param_dtype=jnp.bfloat16)
    step = zs.make_train_step(awkward_loss, tx, make_mesh(8))
    state, _ = step(state, data[0])
    ckpt = zs.CheckpointManager(tmp_path / "ckpt", tx)
    ckpt.save(state)
    ckpt.wait_until_finished()
    master = zs.to_optax_state(state, tx)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    for n in (8, 4):
        restored = ckpt.restore(make_mesh(n), like=like)
        for a, b in zip(
            *map(jax.tree.leaves, (zs.to_optax_state(restored, tx), master)), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if n == 8:
            after = zs.make_train_step(awkward_loss, tx, make_mesh(n))(restored, data[1])[0]
            ours = step(state, data[1])[0]
            for a, b in zip(*map(jax.tree.leaves, (after.params, ours.params)), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()
