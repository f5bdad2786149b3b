"""Dynamic loss scaling: exact bookkeeping, fp16 underflow rescued, agreed overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, make_mesh, reference_run

import zeroshard as zs


def run(params, data, *, param_dtype, loss_fn=awkward_loss, inner=None, **options):
    mesh = make_mesh(8)
    inner = inner or optax.sgd(0.1)
    tx = zs.sharded(inner, axis_name="data", reduce_dtype=jnp.float32, **options)
    state = zs.init_train_state(params, tx, mesh, param_dtype=param_dtype)
    step = zs.make_train_step(loss_fn, tx, mesh)
    history = []  # (loss, scale, good steps) after each step
    for batch in data:
        state, metrics = step(state, batch)
        scale = state.opt_state.loss_scale
        scale = (None, None) if scale is None else (float(scale.scale), int(scale.good_steps))
        history.append((float(metrics["loss"]), *scale))
    return state, history


def test_power_of_two_scaling_is_exact(rng):
    """bf16 has fp32's exponent range: scaling by 2^10 and back changes no bit."""
    params, data = awkward_params(rng), batches(rng, 3)
    scaled, history = run(
        params, data, param_dtype=jnp.bfloat16, loss_scale=zs.DynamicLossScale(2.0**10)
    )
    plain, plain_history = run(params, data, param_dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(scaled.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(a, b)
    masters = (scaled.opt_state.master, plain.opt_state.master)
    for a, b in zip(*map(jax.tree.leaves, masters), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [h[0] for h in history] == [h[0] for h in plain_history]  # reported unscaled
    assert float(scaled.opt_state.loss_scale.scale) == 2.0**10
    assert int(scaled.opt_state.loss_scale.good_steps) == 3


def test_fp16_gradients_that_underflow_are_rescued(rng):
    """The loss times 2^-30: its fp16 gradients underflow, so without a scale the
    weights barely move. With a 2^30 scale the fp16 backward sees the loss itself, and
    sgd(0.1 * 2^30) on it is bit for bit sgd(0.1) on the unscaled loss."""
    params, data = awkward_params(rng), batches(rng, 2)
    tiny = lambda p, b: awkward_loss(p, b) * 2.0**-30
    big_lr = optax.sgd(0.1 * 2.0**30)
    normal, _ = run(params, data, param_dtype=jnp.float16)
    rescued, _ = run(
        params,
        data,
        param_dtype=jnp.float16,
        loss_fn=tiny,
        inner=big_lr,
        loss_scale=zs.DynamicLossScale(2.0**30),
    )
    lost, _ = run(params, data, param_dtype=jnp.float16, loss_fn=tiny, inner=big_lr)
    masters = (rescued.opt_state.master, normal.opt_state.master)
    for a, b in zip(*map(jax.tree.leaves, masters), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = lambda state: sum(
        float(np.sum(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True)
    )
    assert moved(lost) < 0.5 * moved(normal)  # most of the update underflowed away
    assert float(rescued.opt_state.loss_scale.scale) == 2.0**30


def test_overflow_halves_the_scale_everywhere_and_finite_steps_grow_it(rng):
    params, data = awkward_params(rng), batches(rng, 5)
    data[1] = {k: np.array(v) for k, v in data[1].items()}
    data[1]["x"][10, 0] = np.nan  # one device's rows
    config = zs.DynamicLossScale(initial=2.0**8, growth_interval=2)
    state, history = run(
        params, data, param_dtype=jnp.float32, inner=optax.adamw(1e-2), loss_scale=config
    )
    assert [h[1] for h in history] == [2.0**8, 2.0**7, 2.0**7, 2.0**8, 2.0**8]
    assert [h[2] for h in history] == [1, 0, 1, 0, 1]
    assert int(state.opt_state.skipped) == 1
    for leaf in jax.tree.leaves(state.opt_state.loss_scale):
        assert leaf.sharding.is_fully_replicated
        values = {float(s.data) for s in leaf.addressable_shards}
        assert len(values) == 1  # every device holds the same scale
    clean = [d for i, d in enumerate(data) if i != 1]
    expected = reference_run(awkward_loss, optax.adamw(1e-2), params, clean)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.max(np.abs(b)), 1e-30))


def test_metrics_report_the_scale_each_step_used_and_the_skipped_step(rng):
    """``metrics["loss_scale"]`` is the scale the step multiplied its loss by (halved
    after the step that overflowed); ``metrics["skipped"]`` marks that step."""
    mesh, params, data = make_mesh(8), awkward_params(rng), batches(rng, 4)
    data[1] = {k: np.array(v) for k, v in data[1].items()}
    data[1]["y"][10, 0] = np.inf  # an inf in one device's gradient
    config = zs.DynamicLossScale(initial=2.0**8, growth_interval=2)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", loss_scale=config)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    reported = []
    for batch in data:
        used = float(state.opt_state.loss_scale.scale)
        state, metrics = step(state, batch)
        assert float(metrics["loss_scale"]) == used
        assert metrics["loss_scale"].dtype == jnp.float32
        reported.append((float(metrics["loss_scale"]), int(metrics["skipped"])))
    assert reported == [(2.0**8, 0), (2.0**8, 1), (2.0**7, 0), (2.0**7, 0)]
    assert float(state.opt_state.loss_scale.scale) == 2.0**8  # grown after 2 finite steps
    plain = zs.sharded(optax.sgd(0.1), axis_name="data")
    plain_state = zs.init_train_state(params, plain, mesh)
    _, metrics = zs.make_train_step(awkward_loss, plain, mesh)(plain_state, data[0])
    assert "loss_scale" not in metrics and int(metrics["skipped"]) == 0


def test_a_scale_too_large_for_fp16_backs_off_until_finite(rng):
    """2^24 overflows the fp16 backward (max 65504): each such step is skipped on every
    device and halves the scale, until the gradients fit; then it trains."""
    params, data = awkward_params(rng), batches(rng, 16)
    state, history = run(
        params, data, param_dtype=jnp.float16, loss_scale=zs.DynamicLossScale(2.0**24)
    )
    skipped = int(state.opt_state.skipped)
    # Independently: while steps are skipped the weights stay put, so step i overflows
    # iff some device's fp16 gradient of its 2 rows, at scale 2^(24 - i), is not finite.
    fp16 = jax.tree.map(lambda x: x.astype(jnp.float16), params)

    def overflows(i: int) -> bool:
        scaled = lambda p, b: awkward_loss(p, b).astype(jnp.float32) * 2.0 ** (24 - i)
        parts = [jax.tree.map(lambda x, d=d: x[2 * d : 2 * d + 2], data[i]) for d in range(8)]
        grads = [jax.grad(scaled)(fp16, part) for part in parts]
        return not all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))

    expected = next(i for i in range(len(data)) if not overflows(i))
    assert skipped == expected >= 1
    assert skipped <= len(data) - 3  # enough steps left to see it train
    assert [h[1] for h in history[:skipped]] == [2.0 ** (23 - i) for i in range(skipped)]
    assert [h[2] for h in history[skipped:]] == list(range(1, len(data) - skipped + 1))
    assert float(state.opt_state.loss_scale.scale) == 2.0 ** (24 - skipped)
    assert np.isfinite(float(state.opt_state.grad_norm))


def test_loss_scale_survives_a_checkpoint(rng, tmp_path):
    params, data = awkward_params(rng), batches(rng, 1)
    config = zs.DynamicLossScale(initial=2.0**8, growth_interval=5)
    state, _ = run(params, data, param_dtype=jnp.float32, loss_scale=config)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", reduce_dtype=jnp.float32, loss_scale=config)
    with zs.CheckpointManager(tmp_path / "ckpt", tx) as ckpt:
        ckpt.save(state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(make_mesh(4), params)
    assert float(restored.opt_state.loss_scale.scale) == 2.0**8
    assert int(restored.opt_state.loss_scale.good_steps) == 1


def test_loss_scale_errors():
    with pytest.raises(ValueError, match="needs skip_nonfinite=True"):
        zs.sharded(optax.sgd(0.1), loss_scale=zs.DynamicLossScale(), skip_nonfinite=False)
    with pytest.raises(ValueError, match="factor > 1"):
        zs.sharded(optax.sgd(0.1), loss_scale=zs.DynamicLossScale(factor=1.0))
    with pytest.raises(TypeError, match="zs.DynamicLossScale"):
        zs.sharded(optax.sgd(0.1), loss_scale=2.0**15)
