"""state_bits=8 | 4: the inner optimizer's per-element state of matrices in 8 or 4 bits.

The codes are checked against a NumPy implementation of the documented grids (written
here, apart from zeroshard's), plain optax on one device on the global batch applied
to the decoded state, and themselves across device counts and stages.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_mesh

import zeroshard as zs
from zeroshard.core import piecewise
from zeroshard.core.lowbit import Codes, lowbit
from zeroshard.measuring.instruments import state_bytes_per_device

GRIDS = {8: (256, (127, 16.0), (255, 32.0)), 4: (128, (7, 1.5), (15, 3.0))}
ROOT_POWER = 0.5  # (a square root is coded right on average in its square root)


def np_uniform(blocks: np.ndarray, top: np.ndarray) -> np.ndarray:
    """The documented random number of each element: Wellons' lowbias32 hash of its
    float32 bits, its lane in the block (times 0x9E3779B9) and its block's largest
    magnitude's bits, XOR-ed; the top 24 bits of the hash over 2**24."""
    with np.errstate(over="ignore"):
        lane = np.arange(blocks.shape[-1], dtype=np.uint32) * np.uint32(0x9E3779B9)
        bits = lambda v: v.astype(np.float32).view(np.uint32)
        h = bits(blocks) ^ lane ^ bits(top)
        for shift, times in ((16, 0x7FEB352D), (15, 0x846CA68B)):
            h = (h ^ (h >> np.uint32(shift))) * np.uint32(times)
        h = h ^ (h >> np.uint32(16))
    return (h >> np.uint32(8)).astype(np.float64) / 2**24


def np_encode(x: np.ndarray, bits: int, up: bool | None = None):
    """The documented code of ``x`` (1-D, a multiple of the block): codes (one per
    element, unpacked), scales, and where the code is clear (the element's position
    on its grid is not within 1e-4 of a grid point, nor its odds of rounding up
    within 1e-4 of its random number: float32's log2 and division may fall either
    way there). ``up``: every value between two grid points rounded up (``True``)
    or down (``False``) instead."""
    block, (ls, rs), (lu, ru) = GRIDS[bits]
    blocks = x.astype(np.float32).reshape(-1, block)
    roots = (blocks >= 0).all(axis=1, keepdims=True)
    values = np.where(roots, np.sqrt(np.maximum(blocks, 0)), blocks)
    top = np.abs(values).max(axis=1, keepdims=True)
    ratio = np.abs(values).astype(np.float64) / np.where(top > 0, top, 1)
    levels, per_binade = np.where(roots, lu, ls), np.where(roots, ru, rs)
    with np.errstate(divide="ignore"):
        position = levels + per_binade * np.log2(ratio)
    below = np.where(ratio > 0, np.clip(np.floor(position), 0, levels), 0)
    power = np.where(roots, ROOT_POWER, 1)
    value = lambda m: np.where(m > 0, np.exp2((m - levels) / per_binade), 0) ** power
    with np.errstate(invalid="ignore"):
        p = (ratio**power - value(below)) / (value(below + 1) - value(below))
    u = np_uniform(blocks, top) if up is None else np.full(blocks.shape, 0.0 if up else 1.0)
    m = below + (u < p)
    m = np.where(roots & (ratio > 0), np.maximum(m, 1), m).astype(np.uint8)
    sign = np.where((blocks < 0) & ~roots & (m > 0), 1 << (bits - 1), 0).astype(np.uint8)
    scales = np.where(roots, -top, top)[:, 0]
    with np.errstate(invalid="ignore"):
        on_grid = np.abs(position - np.round(position)) < 1e-4
    clear = (ratio == 0) | ~(on_grid | (np.abs(u - p) < 1e-4))
    return (m | sign).reshape(-1), scales, clear.reshape(-1)


def np_decode(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    block, (ls, rs), (lu, ru) = GRIDS[bits]
    code = codes.reshape(-1, block).astype(np.float32)
    s = scales[:, None]
    m = code % (1 << (bits - 1))
    signed = np.where(m > 0, np.exp2((m - ls) / rs), 0) * s
    signed = np.where(code >= (1 << (bits - 1)), -signed, signed)
    roots = np.where(code > 0, np.exp2((code - lu) / ru), 0) * -s
    return np.where(s < 0, roots * roots, signed).reshape(-1).astype(np.float32)


def unpacked(codes: Codes) -> np.ndarray:
    """One code per element, in the leaf's order (4 bits: the low nibble first)."""
    c = np.asarray(codes.codes).reshape(-1)
    return c if codes.bits == 8 else np.stack([c & 0xF, c >> 4], axis=-1).reshape(-1)


def mixed_values(rng, blocks: int, block: int) -> np.ndarray:
    """Signed blocks, non-negative blocks spanning many binades (a second moment),
    and an all-zero block."""
    signed = rng.normal(size=(blocks, block)) * np.exp2(rng.uniform(-20, 5, size=(blocks, 1)))
    second = np.exp2(rng.uniform(-40, 0, size=(blocks, block)))
    x = np.concatenate([signed, second, np.zeros((1, block))])
    return x.reshape(-1).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_codes_are_the_documented_grids(bits, rng):
    """zeroshard's codes equal the NumPy reference's (the stochastic rounding with
    the documented hash), but for elements whose rounding float32 may decide either
    way; decoding gives the reference's values, and coding the decoded values again
    gives the same codes (what a checkpoint restore relies on)."""
    store = lowbit(bits)
    x = mixed_values(rng, 6, store.block)
    coded = store.encode(jnp.asarray(x))
    codes, scales, clear = np_encode(x, bits)
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(unpacked(coded)[clear], codes[clear])
    np.testing.assert_array_equal(np.asarray(coded.scales), scales)
    decoded = np.asarray(store.decode(coded))
    # (exp2, the scale's product and the square: a few float32 roundings, 16 eps)
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(decoded, np_decode(unpacked(coded), scales, bits), rtol=16 * eps)
    again = store.encode(jnp.asarray(decoded))
    np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(coded.codes))
    np.testing.assert_array_equal(np.asarray(again.scales), np.asarray(coded.scales))
    # Each value is coded as one of the two grid points around it: relative to the
    # value (its square root, in a non-negative block), off by less than a grid step,
    # where the value is at least the grid's smallest point.
    block, (ls, rs), (lu, ru) = GRIDS[bits]
    scale = np.repeat(np.asarray(coded.scales), block)
    signed = scale > 0
    ratio = np.where(signed, np.abs(x), np.sqrt(np.abs(x))) / np.abs(np.where(scale, scale, 1))
    smallest = np.where(signed, np.exp2((1 - ls) / rs), np.exp2((1 - lu) / ru))
    on = (ratio >= smallest) & (scale != 0)
    d, v = decoded[on], x[on]
    err = np.abs(d - v) / np.abs(v)
    root_err = np.abs(np.sqrt(np.abs(d)) - np.sqrt(np.abs(v))) / np.sqrt(np.abs(v))
    assert err[signed[on]].max() < 2 ** (1 / rs) - 1
    assert root_err[~signed[on]].max() < 2 ** (1 / ru) - 1
    assert (np.sign(d) == np.sign(v)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_rounding_is_unbiased(bits, rng):
    """The decoded magnitudes sum to the values' (a second moment's: the fourth roots
    of the decoded values, the square roots of the coded square roots), within 5
    standard deviations: each element's error has mean zero, so the sum's has a
    standard deviation of the root of the summed squared errors. Rounding to the
    nearest point of the grid leans one way everywhere, and fails this. (Square
    roots below the grid are coded as its smallest point, not zero: they are left
    out.)"""
    store = lowbit(bits)
    n = 256 * store.block
    _, _, (levels, per_binade) = GRIDS[bits]
    smallest_root = np.exp2((1 - levels) / per_binade)
    signed, second = rng.normal(size=n), rng.uniform(smallest_root, 1, size=n) ** 2
    for x, power in ((signed, 1), (second, ROOT_POWER / 2)):
        x = x.astype(np.float32).astype(np.float64)
        decoded = np.asarray(store.decode(store.encode(jnp.asarray(x, jnp.float32))), np.float64)
        error = np.abs(decoded) ** power - np.abs(x) ** power
        assert abs(error.sum()) <= 5 * np.sqrt(np.sum(error**2))


def model(rng) -> dict:
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
    return {"w1": f(128, 136), "b1": jnp.zeros(136), "w2": f(136, 8), "b2": jnp.zeros(8)}


def loss_fn(p, batch, stage=1):
    p = zs.gather(p) if stage == 3 else p
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)


def data(seed: int, steps: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(32, 128), "y": f(32, 8)} for _ in range(steps)]


def coded_leaves(state) -> dict:
    """The logical prefix of every coded leaf's codes and scales (the pieces, laid end
    to end, are the raveled leaf, padded at its end)."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(state.opt_state.inner_state, is_leaf=zs_codes)
    for path, x in leaves[0]:
        if zs_codes(x):
            out[jax.tree_util.keystr(path)] = (unpacked(x), np.asarray(x.scales).reshape(-1))
    return out


def zs_codes(x) -> bool:
    return isinstance(x, Codes)


def run(bits, n, steps, stage=1, accum=1, deterministic=16, seed=0, inner=None, **options):
    params, mesh = model(np.random.default_rng(seed)), make_mesh(n)
    inner = inner or optax.adam(1e-2)
    tx = zs.sharded(inner, state_bits=bits, deterministic=deterministic, **options)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(
        lambda p, b: loss_fn(p, b, stage), tx, mesh, stage=stage, accum_steps=accum
    )
    for batch in data(seed, steps):
        state, _ = step(state, batch)
    return state, tx


@pytest.mark.parametrize("bits,piece", [(8, None), (4, None), (8, 512)])
def test_the_codes_are_the_same_on_1_2_4_and_8_devices(bits, piece, monkeypatch):
    """With deterministic=, 10 steps on 1, 2, 4 and 8 devices store the same codes and
    scales (np.array_equal): blocks follow each leaf's global index. Also where each
    device updates its state two blocks at a time (``piece``: 34 pieces of w1 on one
    device, 9 of one block each on 8)."""
    if piece:
        monkeypatch.setattr(piecewise, "PIECE", piece)
    runs = [coded_leaves(run(bits, n, 10)[0]) for n in (1, 2, 4, 8)]
    assert set(runs[0]) == {"[0].mu['w1']", "[0].mu['w2']", "[0].nu['w1']", "[0].nu['w2']"}
    sizes = {"w1": 128 * 136, "w2": 136 * 8}
    for got in runs[1:]:
        for k, (codes, scales) in got.items():
            size = sizes[k[-4:-2]]
            block = GRIDS[bits][0]
            np.testing.assert_array_equal(codes[:size], runs[0][k][0][:size])
            np.testing.assert_array_equal(
                scales[: -(-size // block)], runs[0][k][1][: -(-size // block)]
            )


@pytest.mark.parametrize(
    "bits,stage,accum,piece,clip",
    [
        (8, 1, 1, None, False),
        (4, 1, 1, None, False),
        (8, 1, 2, None, False),
        (8, 2, 2, None, False),
        (4, 3, 1, None, False),
        (8, 3, 2, None, False),
        (4, 2, 1, 128, False),
        (8, 3, 1, None, True),
    ],
)
def test_one_step_is_plain_optax_on_the_decoded_state(bits, stage, accum, piece, clip, monkeypatch):
    """After 5 steps on 8 devices, at every stage, with and without accumulation: one
    more step gives the weights of plain optax on one device, on the global batch, from
    the decoded state (to_optax_state), and stores plain optax's new state as one of
    the two grid points around each value (the NumPy reference's, rounded down or up:
    which one is the coin's, and the coin follows the value's last bits). Also where
    the state is updated a block at a time (``piece``), and after a global-norm clip
    (``clip``: a sum over every element, so each device's state is decoded whole)."""
    if piece:
        monkeypatch.setattr(piecewise, "PIECE", piece)
    inner = optax.adam(1e-2)
    inner = optax.chain(optax.clip_by_global_norm(0.1), inner) if clip else inner
    state, tx = run(bits, 8, 5, stage=stage, accum=accum, deterministic=None, inner=inner)
    params, opt_state = jax.device_get(zs.to_optax_state(state, tx))  # (on one device)
    batch = data(1, 1)[0]
    grads = jax.grad(loss_fn)(params, batch)
    updates, expected_state = inner.update(grads, opt_state, params)
    adam, prefix = (expected_state[1], "[1]") if clip else (expected_state, "")
    expected = optax.apply_updates(params, updates)
    loss = lambda p, b: loss_fn(p, b, stage)
    step = zs.make_train_step(loss, tx, make_mesh(8), stage=stage, accum_steps=accum)
    state, _ = step(state, batch)
    new = zs.to_optax_state(state, tx)[0] if stage == 3 else state.params
    for k in expected:
        np.testing.assert_allclose(new[k], expected[k], rtol=2e-5, atol=1e-7)
    got = coded_leaves(state)
    for name in ("mu", "nu"):
        for leaf in ("w1", "w2"):
            x = np.asarray(getattr(adam[0], name)[leaf]).reshape(-1)
            block = GRIDS[bits][0]
            x = np.pad(x, (0, -len(x) % block))
            (down, scales, clear), (up, _, _) = np_encode(x, bits, False), np_encode(x, bits, True)
            mine, my_scales = got[f"{prefix}[0].{name}['{leaf}']"]
            np.testing.assert_allclose(my_scales[: len(scales)], scales, rtol=1e-5)
            mine = np_decode(mine[: len(x)], my_scales[: len(scales)], bits)
            down, up = (np_decode(c, scales, bits) for c in (down, up))
            near_down, near_up = np.isclose(mine, down, rtol=1e-4), np.isclose(mine, up, rtol=1e-4)
            assert clear.mean() > 0.95
            assert (near_down | near_up)[clear].all()
            assert near_down.mean() > 0.1 and near_up.mean() > 0.1  # (both: the rounding's)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_non_finite_step_keeps_the_codes_and_weights(stage, monkeypatch):
    """A batch with a nan, where the state is updated two blocks at a time: every
    device skips the step, and the weights, codes and scales stay bitwise as they were
    (the pieces' loop runs no time, the rest of the update is in a conditional)."""
    monkeypatch.setattr(piecewise, "PIECE", 512)
    state, tx = run(8, 8, 2, stage=stage)
    batch = data(1, 1)[0]
    batch["x"] = batch["x"].at[5, 3].set(jnp.nan)
    before = jax.device_get((state.params, state.opt_state.inner_state))
    step = zs.make_train_step(lambda p, b: loss_fn(p, b, stage), tx, make_mesh(8), stage=stage)
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 1
    after = jax.device_get((state.params, state.opt_state.inner_state))
    assert len(coded_leaves(state)) == 4
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


@functools.cache
def stacked_step_memory(bits, layers: int, stage: int) -> zs.StepMemory:
    """The compiled memory of a step (Adam, N = 8, abstract values) of ``layers`` stacked
    layers of 512 x 1024, each gathered in a scan (``zs.layer``)."""
    params = {"w": jax.ShapeDtypeStruct((layers, 512, 1024), jnp.float32)}
    block = zs.layer(lambda p, x: jnp.tanh(x @ p["w"])[:, :512])

    def loss(p, batch):
        return jnp.mean(jax.lax.scan(lambda x, p: (block(p, x), None), batch, p)[0] ** 2)

    tx = zs.sharded(optax.adam(1e-3), stacked=["w"], state_bits=bits)
    batch = jax.ShapeDtypeStruct((16, 512), jnp.float32)
    return zs.step_memory(loss, tx, make_mesh(8), params, batch, stage=stage)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_coded_update_holds_one_piece_of_decoded_state(bits):
    """The temporaries of a stage-3 step with coded state grow from 4 to 8 layers by no
    more than the float32-state step's do plus one layer's float32 moments (65,536
    elements of each per device): the state is decoded a piece at a time, not the
    device's whole slice at once (decoded whole, they grew by 12 MiB). At 32 layers its
    peak is at least 0.6 bytes per parameter below the float32-state step's, and no
    higher at 4 bits than at 8 (with the pieces' loop in the non-finite conditional,
    whose outputs are buffers of their own, a second copy of the weights and codes
    left 0.49 on jax 0.12). And at stage 2 (its loss gathers each layer: the gradients
    reduce-scattered layer by layer), the step with coded state has a lower peak than
    with float32 state."""
    temps = {
        (b, n): stacked_step_memory(b, n, stage=3).temporaries for b in (None, bits) for n in (4, 8)
    }
    grown = lambda b: temps[b, 8] - temps[b, 4]
    assert grown(bits) <= grown(None) + 2 * 4 * 512 * 1024 // 8
    peak = lambda b: stacked_step_memory(b, 32, stage=3).peak
    assert peak(bits) <= peak(None) - 0.6 * 32 * 512 * 1024
    assert peak(4) <= peak(8)
    assert stacked_step_memory(bits, 8, stage=2).peak < stacked_step_memory(None, 8, 2).peak


@pytest.mark.parametrize("bits,limit", [(8, 0.27), (4, 0.15)])
def test_the_state_bytes_per_device(bits, limit):
    """Adam at N = 8 on a scan-stacked transformer's shapes (4 layers of width 256,
    a 4096-token embedding): the state on a device is at most 0.27x (8 bits) or 0.15x
    (4 bits) of the float32 sharded state, scales included; zs.estimate_memory says
    the same bytes."""
    d, layers = 256, 4
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    params = {
        "embed": s(4096, d),
        "blocks": {
            "qkv": s(layers, d, 3 * d),
            "out": s(layers, d, d),
            "up": s(layers, d, 4 * d),
            "down": s(layers, 4 * d, d),
            "ln": s(layers, d),
        },
        "ln_f": s(d),
    }
    mesh = make_mesh(8)
    held = {}
    for b in (None, bits):
        tx = zs.sharded(optax.adam(1e-3), state_bits=b, stacked=["blocks"])
        state = jax.eval_shape(functools.partial(zs.init_train_state, tx=tx, mesh=mesh), params)
        specs = zs.make_train_step(loss_fn, tx, mesh).state_specs(params)
        placed = jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=jax.NamedSharding(mesh, spec)
            ),
            state.opt_state.inner_state,
            specs.opt_state.inner_state,
        )
        held[b] = state_bytes_per_device(placed)
        # (the planner counts the codes and scales as they are laid out)
        assert zs.estimate_memory(params, 8, optimizer=tx).optimizer_state == held[b]
    assert held[bits] <= limit * held[None]


def test_a_checkpoint_restores_the_codes_on_another_device_count(tmp_path):
    """Saved on 8 devices as plain optax's decoded float32 state, restored on 4: the
    same codes, and the next steps are the uninterrupted run's."""
    state, tx = run(8, 8, 4)
    with zs.CheckpointManager(tmp_path, tx) as manager:
        manager.save(state)
        manager.wait_until_finished()
    with zs.CheckpointManager(tmp_path, tx) as manager:
        restored = manager.restore(make_mesh(4), like=model(np.random.default_rng(0)))
    saved = coded_leaves(state)
    for k, (codes, _) in coded_leaves(restored).items():
        n = min(len(codes), len(saved[k][0]))
        np.testing.assert_array_equal(codes[: n // 2], saved[k][0][: n // 2])
    more = data(7, 2)
    for s, n in ((state, 8), (restored, 4)):
        step = zs.make_train_step(loss_fn, tx, make_mesh(n))
        for batch in more:
            s, _ = step(s, batch)
        if n == 8:
            expected = s.params
    for k in expected:
        np.testing.assert_array_equal(s.params[k], expected[k])


def test_the_dropin_is_plain_optax_on_the_decoded_state(rng):
    """The one-line drop-in (tx.update in your own jax.jit, state over every device)
    keeps coded state too: after 4 steps, one more equals plain optax on one device
    from the decoded state."""
    params, batches = model(rng), data(3, 5)
    mesh = make_mesh(8)
    tx = zs.sharded(optax.adam(1e-2), state_bits=8)

    @jax.jit
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, u), s

    with jax.set_mesh(mesh):
        p, s = params, tx.init(params)
        for b in batches[:4]:
            p, s = step(p, s, b)
        assert isinstance(s.inner_state[0].mu["w1"], Codes)
        logical = zs.to_optax_state(zs.TrainState(jnp.int32(4), p, s, None), tx)
        p_new, _ = step(p, s, batches[4])
    params, opt_state = jax.device_get(logical)
    grads = jax.grad(loss_fn)(params, batches[4])
    updates, _ = optax.adam(1e-2).update(grads, opt_state, params)
    expected = optax.apply_updates(params, updates)
    for k in expected:
        np.testing.assert_allclose(p_new[k], expected[k], rtol=2e-5, atol=1e-7)


def test_nnx_optimizer_keeps_coded_state():
    """nnx.Optimizer(model, zs.sharded(adam, state_bits=8)) in the user's own nnx.jit
    step: the moments are stored as codes and the step equals the same loop's with
    float32 state to the rounding of the first step's coded moments (one step: the
    same update but for the moments' codes, which Adam's first update reads)."""
    from flax import nnx

    def first_step(bits):
        mesh = make_mesh(8)
        with jax.set_mesh(mesh):
            model = nnx.Linear(128, 256, rngs=nnx.Rngs(0))
            tx = zs.sharded(optax.adam(1e-2), state_bits=bits)
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
            batch = data(2, 1)[0]

            @nnx.jit
            def step(model, optimizer, x):
                loss = lambda m: jnp.mean(m(x) ** 2)
                optimizer.update(model, nnx.grad(loss)(model))

            step(model, optimizer, batch["x"])
        return nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state)

    exact, _ = first_step(None)
    coded, state = first_step(8)
    assert isinstance(state.inner_state[0].mu["kernel"], Codes)
    # Adam's first step is lr * sign(g) up to eps (m / sqrt(v) = g / |g|): coded moments
    # round m and sqrt(v) by at most 4.4% and 2.2%, so the step by at most 7%.
    step = np.abs(np.asarray(exact["kernel"]) - np.asarray(model_kernel()))
    diff = np.abs(np.asarray(coded["kernel"]) - np.asarray(exact["kernel"]))
    assert np.all(diff <= 0.07 * step + 1e-7)


def model_kernel():
    from flax import nnx

    return nnx.Linear(128, 256, rngs=nnx.Rngs(0)).kernel[...]


def test_quantized_collectives_with_coded_state():
    """int8 gradients and weights with 8-bit state: the mean loss of the last 10 of 30
    steps on fresh batches is within 1% of the same run's with float32 state (the
    bound the 8-bit state keeps)."""
    losses = {}
    for bits in (None, 8):
        tx = zs.sharded(
            optax.adam(3e-3), state_bits=bits, quantize_grads="int8", quantize_weights="int8"
        )
        mesh = make_mesh(8)
        state = zs.init_train_state(model(np.random.default_rng(0)), tx, mesh)
        step = zs.make_train_step(loss_fn, tx, mesh)
        seen = []
        for batch in data(5, 30):
            state, metrics = step(state, batch)
            seen.append(float(metrics["loss"]))
        losses[bits] = np.mean(seen[-10:])
    assert abs(losses[8] - losses[None]) <= 0.01 * losses[None]


def test_bad_state_bits_are_refused():
    with pytest.raises(ValueError, match="state_bits must be 8, 4 or None"):
        zs.sharded(optax.adam(1e-3), state_bits=16)


def test_coded_state_on_a_tensor_parallel_mesh():
    """On 4 data x 2 model with column/row-parallel kernels (kept block by block,
    Megatron's rule) the codes are laid out as the blocks' pieces, and one step equals
    plain optax on one device from the decoded state."""
    from test_every_axis import tp_batches, tp_placed, tp_step_loss

    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
    params, batches = {"up": f(16, 64), "down": f(64, 16), "b": f(16)}, tp_batches(rng)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = zs.sharded(optax.adam(1e-2), state_bits=8)
    state = zs.init_train_state(tp_placed(params, mesh), tx, mesh)
    step = zs.make_train_step(tp_step_loss, tx, mesh)
    with jax.set_mesh(mesh):
        for batch in batches[:3]:
            state, _ = step(state, batch)
        mu = state.opt_state.inner_state[0].mu["up"]
        assert isinstance(mu, Codes) and mu.codes.sharding.spec == jax.P("model", "data")
        logical = jax.device_get(zs.to_optax_state(state, tx))
        state, _ = step(state, batches[3])
    params, opt_state = logical
    grads = jax.grad(tp_step_loss)(params, batches[3])
    updates, _ = optax.adam(1e-2).update(grads, opt_state, params)
    expected = optax.apply_updates(params, updates)
    for k in expected:
        np.testing.assert_allclose(state.params[k], expected[k], rtol=2e-5, atol=1e-7)
