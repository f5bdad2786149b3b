"""Stages 1 and 2 with gradient accumulation: parity with plain optax, and memory."""

import re

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
    make_mesh,
    reference_run,
)

import zeroshard as zs

OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.1, momentum=0.9), 1e-6),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), 1e-5),
}


@pytest.mark.parametrize("accum_steps", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stage_and_accumulation_match_plain_optax(name, stage, accum_steps, rng):
    make, rtol = OPTIMIZERS[name]
    params, data = awkward_params(rng), batches(rng, 3, size=32)
    expected = reference_run(awkward_loss, make(), params, data)  # the whole global batch
    mesh = make_mesh(8)
    tx = zs.sharded(make(), axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh, stage=stage, accum_steps=accum_steps)
    for batch in data:
        state, metrics = train_step(state, batch)
    assert_trees_close(state.params, expected, rtol)
    assert jnp.isfinite(metrics["loss"])


def test_accumulated_metrics_are_the_global_batch_ones(rng):
    params, data = awkward_params(rng), batches(rng, 1, size=32)
    mesh = make_mesh(4)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    for stage in (1, 2):
        state = zs.init_train_state(params, tx, mesh)
        step = zs.make_train_step(awkward_loss, tx, mesh, stage=stage, accum_steps=4)
        _, metrics = step(state, data[0])
        loss, grads = jax.value_and_grad(awkward_loss)(params, data[0])
        assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)
        assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-6)


def _loop_operands(lowered_text: str) -> list[str]:
    """The operand types of every ``stablehlo.while`` (what the scan carries across
    iterations, with its loop-invariant inputs), e.g. ``"256x256xf32"``."""
    types = []
    for line in lowered_text.splitlines():
        if "stablehlo.while(" in line:
            types += re.findall(r"tensor<([^>]*)>", line.split(") : ", 1)[1])
    return types


def test_stage2_has_no_full_size_gradient_accumulator(rng):
    """bf16 params (carried as bf16), fp32 accumulators: stage 1 carries a full-size
    fp32 gradient across micro-batches, stage 2 only 1/N pieces of it."""
    n, k, width = 8, 4, 256
    params, mesh = layered_params(rng, width=width), make_mesh(n)
    batch = {"x": jnp.ones((n * k * 2, width)), "y": jnp.zeros((n * k * 2, width))}
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    f32 = {}
    for stage in (1, 2):
        step = zs.make_train_step(layered_loss, tx, mesh, stage=stage, accum_steps=k)
        f32[stage] = sorted(
            t for t in _loop_operands(step.lower(state, batch).as_text()) if t.endswith("xf32")
        )
    full = [f"{width}x{width}xf32"] * 4 + [f"{width}xf32"] * 4
    pieces = [f"{width * width // n}xf32"] * 4 + [f"{width // n}xf32"] * 4
    assert all(f32[1].count(t) >= full.count(t) for t in set(full)), f32[1]
    assert not set(full) & set(f32[2]), f32[2]
    assert all(f32[2].count(t) >= pieces.count(t) for t in set(pieces)), f32[2]


def test_bad_stage_and_accumulation_arguments(rng):
    params, mesh = awkward_params(rng), make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        zs.make_train_step(awkward_loss, tx, mesh, stage=4)
    with pytest.raises(ValueError, match="accum_steps must be a positive integer"):
        zs.make_train_step(awkward_loss, tx, mesh, accum_steps=0)
    step = zs.make_train_step(awkward_loss, tx, mesh, accum_steps=4)
    state = zs.init_train_state(params, tx, mesh)
    with pytest.raises(ValueError, match="times accum_steps=4.*multiple of 32"):
        step(state, batches(rng, 1, size=16)[0])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_device_step_is_plain_optax(stage, rng):
    """N = 1: no collective, padding, concatenation or slicing in the step; same numbers."""
    params, data = awkward_params(rng), batches(rng, 2)
    expected = reference_run(awkward_loss, optax.adamw(1e-2), params, data)
    mesh = make_mesh(1)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    gathered = lambda p, b: awkward_loss(zs.gather(p), b)
    train_step = zs.make_train_step(gathered if stage == 3 else awkward_loss, tx, mesh, stage=stage)
    hlo = train_step.lower(state, data[0]).compile().as_text()
    assert zs.compiled_collectives(hlo, 1) == []
    ops = set(re.findall(r"=\s*\S+(?:\{[^}]*\})?\s+([a-z][\w-]*)\(", hlo))
    assert not ops & {"pad", "concatenate", "slice", "dynamic-slice", "all-reduce"}, ops
    for batch in data:
        state, _ = train_step(state, batch)
    whole = lambda x: np.asarray(x.piece).reshape(x.shape) if isinstance(x, zs.Piece) else x
    params = jax.tree.map(whole, state.params, is_leaf=lambda x: isinstance(x, zs.Piece))
    assert_trees_close(params, expected, rtol=1e-5)
