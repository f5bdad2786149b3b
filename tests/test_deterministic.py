"""deterministic=M: the same global batch gives the same bits on 1, 2, 4 and 8 devices.

Every run is compared with ``np.array_equal`` (no tolerance) across device counts, and
the one-device run with plain optax on one device on the global batch (within rounding:
the fixed order is one order among others).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_within_bf16_rounding, make_mesh, reference_run

import zeroshard as zs
from zeroshard.communication import canonical

PARTS, STEPS, ROWS = 16, 20, 32  # micro-batches (2 per device on 8), steps, global batch


def model(rng: np.random.Generator) -> dict:
    """An MLP whose first matrix Adafactor factors (both dims >= 128) and Muon
    orthogonalizes (owned whole); the other leaves are sliced."""
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
    return {"w1": f(128, 136), "b1": jnp.zeros(136), "w2": f(136, 5), "b2": jnp.zeros(5)}


def loss_fn(p, batch, stage=1, key=None, model_state=None):
    if stage == 3:
        p = zs.gather(p)
    p = jax.tree.map(lambda x: x.astype(jnp.float32), p)
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    if key is not None:  # dropout, by the micro-batch's key
        h = jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0)
    err = (h @ p["w2"] + p["b2"] - batch["y"]) ** 2
    loss = jnp.mean(err)
    if model_state is None:
        return loss
    # A BatchNorm-style running mean of the hidden units, and per-example aux.
    mean = 0.9 * model_state["mean"] + 0.1 * jnp.mean(h, axis=0)
    return loss, ({"mean": mean}, {"per_example": jnp.mean(err, axis=1)})


def data(seed: int, steps: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": jnp.asarray(rng.normal(size=(ROWS, 128)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(ROWS, 5)), jnp.float32),
        }
        for _ in range(steps)
    ]


OPTIMIZERS = {
    "adamw+clip": lambda: optax.chain(optax.clip_by_global_norm(0.3), optax.adamw(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
}


def train(n, name, stage=1, dtype=jnp.float32, steps=STEPS, extras=False, state=None, replicas=1):
    """``steps`` steps on the first ``n`` devices (``replicas`` of them over a replica
    axis); returns the state, its logical form (params, optimizer state) and the
    metrics of every step."""
    mesh, tx = make_mesh(n), zs.sharded(OPTIMIZERS[name](), deterministic=PARTS)
    if replicas > 1:
        mesh = jax.make_mesh((replicas, n // replicas), ("replica", "data"))
        tx = zs.sharded(OPTIMIZERS[name](), deterministic=PARTS, replica_axis="replica")
    rng = np.random.default_rng(0)
    params = model(rng)
    model_state = {"mean": jnp.zeros(136)} if extras else None
    if state is None:
        state = zs.init_train_state(
            params, tx, mesh, param_dtype=dtype, stage=stage, model_state=model_state
        )
    step = zs.make_train_step(
        lambda p, b, **kw: loss_fn(p, b, stage, **kw), tx, mesh, stage=stage, has_aux=extras
    )
    metrics = []
    for i, batch in enumerate(data(1, STEPS)[int(state.step) : int(state.step) + steps]):
        key = jax.random.key(i) if extras else None
        state, m = step(state, batch, key)
        metrics.append(jax.tree.map(np.asarray, m))
    return state, jax.tree.map(np.asarray, zs.to_optax_state(state, tx)), metrics


def assert_equal(actual, expected, what: str) -> None:
    flat = jax.tree_util.tree_leaves_with_path(expected)
    for (path, e), a in zip(flat, jax.tree.leaves(actual), strict=True):
        assert np.array_equal(a, e), f"{what}: {jax.tree_util.keystr(path)} differs"


# Every optimizer, stage and dtype; the default tier runs 4 of them (each optimizer, each
# stage, each dtype), the slow tier the others (tests/conftest.py).
CASES = [
    (name, stage, dtype)
    for name in OPTIMIZERS
    for stage in (1, 2, 3)
    for dtype in (jnp.float32, jnp.bfloat16)
]


@pytest.mark.parametrize("name,stage,dtype", CASES, ids=lambda c: getattr(c, "__name__", c))
def test_bit_identical_on_1_2_4_8_devices(name, stage, dtype):
    runs = {n: train(n, name, stage, dtype) for n in (1, 2, 4, 8)}
    for n in (2, 4, 8):
        assert_equal(runs[n][1], runs[1][1], f"{n} devices vs 1")
        assert [m["loss"] for m in runs[n][2]] == [m["loss"] for m in runs[1][2]]
    # One order among others: plain optax on one device on the global batch, within
    # rounding (bf16 compute: the reference's bf16 gradient of each micro-batch).
    params = model(np.random.default_rng(0))
    compute = None if dtype == jnp.float32 else dtype
    inner = OPTIMIZERS[name]()
    expected = reference_run(
        lambda p, b: loss_fn(p, b), inner, params, data(1, STEPS), compute, PARTS
    )
    if compute is None:  # 20 steps of rounding apart (a wrong sum is 1e-2 and more off)
        assert_trees_close(runs[1][1][0], expected, rtol=1e-4)
    else:  # a bf16 rounding of the weights apart moves a gradient by a bf16 ulp
        assert_within_bf16_rounding(runs[1][1][0], expected, params)


def test_dropout_model_state_and_aux_do_not_depend_on_the_device_count():
    runs = {n: train(n, "adamw+clip", extras=True) for n in (1, 2, 8)}
    for n in (2, 8):
        assert_equal(runs[n][1], runs[1][1], f"{n} devices vs 1")
        assert_equal(runs[n][0].model_state, runs[1][0].model_state, "model state")
        assert_equal(runs[n][2], runs[1][2], "metrics (loss, grad norm, per-example aux)")
    aux = runs[1][2][-1]["aux"]["per_example"]
    assert aux.shape == (ROWS,) and np.all(aux > 0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_replica_axis_sums_in_the_same_order(stage):
    """2 replicas x 4 devices and 4 x 2 give the bits of 1 device: the replicas' rows
    are summed in the same tree as every other device's."""
    expected = train(1, "adamw+clip", stage, steps=4, extras=True)
    for replicas in (2, 4):
        actual = train(8, "adamw+clip", stage, steps=4, extras=True, replicas=replicas)
        assert_equal(actual[1], expected[1], f"{replicas} replicas x {8 // replicas}")
        assert_equal(actual[0].model_state, expected[0].model_state, "model state")
        assert_equal(actual[2], expected[2], "metrics (loss, grad norm, per-example aux)")


def test_save_on_8_restore_on_4_and_1_continues_bit_for_bit(tmp_path):
    uninterrupted = train(8, "adamw+clip", stage=1)[1]
    state, _, _ = train(8, "adamw+clip", stage=1, steps=10)
    tx = zs.sharded(OPTIMIZERS["adamw+clip"](), deterministic=PARTS)
    with zs.CheckpointManager(tmp_path / "ckpt", tx) as ckpt:
        ckpt.save(state)
    like = model(np.random.default_rng(0))
    for n in (4, 1):
        restored = zs.CheckpointManager(tmp_path / "ckpt", tx).restore(make_mesh(n), like=like)
        assert int(restored.step) == 10
        resumed = train(n, "adamw+clip", stage=1, steps=10, state=restored)[1]
        assert_equal(resumed, uninterrupted, f"saved on 8, resumed on {n}")


def test_the_device_order_of_the_sum_is_what_makes_the_bits_agree(monkeypatch):
    """A planted fault: each owner sums the devices' gradients of a round (stage 2) in
    the other tree, neighbours first instead of halves (``(d0 + d1) + (d2 + d3)``, not
    ``(d0 + d2) + (d1 + d3)``). On 4 and 8 devices the run then differs from the one
    on 1 (which sums its rounds in the right tree), so the bit-identity check above
    can fail."""
    expected = train(1, "adamw+clip", stage=2, steps=3)[1]
    summed_rows, other = canonical.summed_rows, {canonical.HIGH: canonical.LOW}
    flipped = lambda blocks, axis, order=canonical.HIGH, replicas=None: summed_rows(
        blocks, axis, other[order], replicas
    )
    monkeypatch.setattr(canonical, "summed_rows", flipped)
    for n in (4, 8):
        actual = train(n, "adamw+clip", stage=2, steps=3)[1]
        leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
        assert not all(np.array_equal(a, e) for a, e in leaves), f"{n} devices"


def test_refused_where_the_bits_cannot_agree():
    params, mesh = model(np.random.default_rng(0)), make_mesh(8)
    with pytest.raises(ValueError, match="power of two"):
        zs.sharded(optax.sgd(0.1), deterministic=12)
    with pytest.raises(ValueError, match="quantize_grads"):
        zs.sharded(optax.sgd(0.1), quantize_grads="int8", deterministic=8)
    for parts in (4, 8):  # fewer than two micro-batches per device
        with pytest.raises(ValueError, match=f"deterministic={parts} gives the same bits"):
            zs.make_train_step(loss_fn, zs.sharded(optax.sgd(0.1), deterministic=parts), mesh)
    with pytest.raises(ValueError, match="accum_steps"):
        zs.make_train_step(
            loss_fn, zs.sharded(optax.sgd(0.1), deterministic=8), mesh, accum_steps=2
        )
    tx = zs.sharded(optax.sgd(0.1), deterministic=16)
    step = zs.make_train_step(loss_fn, tx, mesh)
    state = zs.init_train_state(params, tx, mesh)
    with pytest.raises(ValueError, match="deterministic=16 micro-batches"):
        step(state, jax.tree.map(lambda x: x[:12], data(0, 1)[0]))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="zs.make_train_step"):
        tx.update(params, tx.init(params), params)
    # The state spans a mesh's other axes too: its devices must divide the chunks.
    two_d = jax.make_mesh((2, 4), ("data", "model"))
    for parts, fix in ((4, "deterministic=8 or a larger"), (8, None)):
        tx = zs.sharded(optax.sgd(0.1), deterministic=parts)
        if fix is None:
            zs.make_train_step(loss_fn, tx, two_d)
            continue
        with pytest.raises(ValueError, match=f"split over the 8 devices.*{fix}"):
            zs.make_train_step(loss_fn, tx, two_d)


def test_the_nnx_step_is_bit_identical_on_1_2_8_devices():
    """zs.flax.nnx_train_step takes deterministic= from its optimizer too."""
    from flax import nnx
    from test_flax import NNXModel, nnx_loss

    import zeroshard.flax as zf

    runs = []
    for n in (1, 2, 8):
        mesh, model = make_mesh(n), NNXModel(nnx.Rngs(0))
        tx = zs.sharded(OPTIMIZERS["adamw+clip"](), deterministic=PARTS)
        optimizer, step = zf.nnx_optimizer(model, tx, mesh), zf.nnx_train_step(nnx_loss, mesh)
        rng = np.random.default_rng(0)
        for _ in range(3):
            x, y = rng.normal(size=(ROWS, 7)), rng.normal(size=(ROWS, 5))
            step(
                model,
                optimizer,
                {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)},
            )
        runs.append(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
    for run in runs[1:]:
        assert_equal(run, runs[0], "the NNX step on 2 or 8 devices vs 1")
