"""A non-finite gradient on one device: every device skips the step, agreed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    BAD_ELEMENTS,
    assert_skipped_everywhere,
    assert_trees_close,
    awkward_loss,
    awkward_params,
    batches,
    check_one_piece_batch,
    make_mesh,
    one_piece_batch,
    one_piece_loss,
    one_piece_params,
    reference_run,
    shards,
)

import zeroshard as zs

SETUPS = {
    "data-8": (lambda: make_mesh(8), None, 1, optax.adamw),
    "data-8-stage3": (lambda: make_mesh(8), None, 3, optax.adamw),
    "replica-2-data-4": (
        lambda: jax.make_mesh((2, 4), ("replica", "data")),
        "replica",
        1,
        optax.adamw,
    ),
    "owned-lamb-replica-2-data-4": (
        lambda: jax.make_mesh((2, 4), ("replica", "data")),
        "replica",
        1,
        optax.lamb,
    ),
}


def poison(batch: dict, row: int, value: float) -> dict:
    """``batch`` with one bad element in row ``row`` (a row only one device gets)."""
    bad = {k: np.array(v) for k, v in batch.items()}
    bad["x" if np.isnan(value) else "y"][row, 0] = value
    return bad


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_replicas_identical(tree) -> None:
    """Every device's copy of every replicated leaf is bitwise the same."""
    for leaf in jax.tree.leaves(tree):
        if leaf.sharding.is_fully_replicated:
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            for s in shards[1:]:
                np.testing.assert_array_equal(s, shards[0])


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_bad_gradient_on_one_device_skips_the_step_everywhere(setup, bad, rng):
    make, replica_axis, stage, optimizer = SETUPS[setup]
    mesh = make()
    params, data = awkward_params(rng), batches(rng, 4)
    inner = optimizer(1e-2)
    tx = zs.sharded(inner, axis_name="data", replica_axis=replica_axis)
    state = zs.init_train_state(params, tx, mesh, stage=stage)

    def loss_fn(p, batch):
        return awkward_loss(zs.gather(p) if stage == 3 else p, batch)

    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    state, metrics = step(state, data[0])
    assert int(metrics["skipped"]) == 0
    before = host(state)
    # Rows 10-11 of 16 go to device 5 only (device (1, 1) of the 2 x 4 mesh).
    state, metrics = step(state, poison(data[1], 10, bad))
    assert not np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["skipped"]) == 1  # this step was skipped
    assert metrics["skipped"].dtype == jnp.int32 and metrics["skipped"].ndim == 0
    assert "loss_scale" not in metrics  # no loss scaling
    assert int(state.opt_state.skipped) == 1
    assert int(state.step) == 2  # the step counter counts batches consumed
    after = host(state)
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(
        jax.tree.leaves((after.opt_state.inner_state, after.opt_state.owned)),
        jax.tree.leaves((before.opt_state.inner_state, before.opt_state.owned)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert_replicas_identical(state)
    # Training then continues as if the bad batch had never come.
    for batch in data[2:]:
        state, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0  # the count stays on the state
    assert np.isfinite(float(metrics["grad_norm"]))
    assert int(state.opt_state.skipped) == 1
    clean = [data[0], *data[2:]]
    expected = reference_run(awkward_loss, inner, params, clean)
    final = state.params if stage < 3 else zs.to_optax_state(state, tx)[0]
    assert_trees_close(final, expected, 1e-5)


def test_without_skipping_the_nan_reaches_the_weights(rng):
    mesh, params, data = make_mesh(8), awkward_params(rng), batches(rng, 1)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", skip_nonfinite=False)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    state, metrics = step(state, poison(data[0], 10, np.nan))
    assert "skipped" not in metrics  # no step is ever skipped
    assert int(state.opt_state.skipped) == 0
    assert np.isnan(np.asarray(state.params["dense"]["w"])).all()


def test_skip_count_survives_a_checkpoint(rng, tmp_path):
    mesh, params, data = make_mesh(8), awkward_params(rng), batches(rng, 1)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    state, _ = zs.make_train_step(awkward_loss, tx, mesh)(state, poison(data[0], 3, np.nan))
    with zs.CheckpointManager(tmp_path / "ckpt", tx) as ckpt:
        ckpt.save(state)
        ckpt.wait_until_finished()
        assert ckpt.metadata()["skipped_steps"] == 1
        restored = ckpt.restore(make_mesh(4), params)
    assert int(restored.opt_state.skipped) == 1


def test_skipping_in_a_hand_written_shard_map_loop(rng):
    """tx.update alone (inside a user's shard_map) skips too: zero updates."""
    mesh, params, data = make_mesh(8), awkward_params(rng), batches(rng, 1)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    specs = tx.state_specs(params, 8)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)

    def step(p, opt_state, batch):
        grads = jax.grad(awkward_loss)(jax.lax.pcast(p, "data", to="varying"), batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(jax.P(), specs, jax.P("data")),
            out_specs=(jax.P(), specs),
        )
    )
    batch = jax.device_put(poison(data[0], 10, np.nan), jax.NamedSharding(mesh, jax.P("data")))
    new, opt_state = step(params, opt_state, batch)
    assert int(opt_state.skipped) == 1
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


ONE_PIECE = {
    "stage1": dict(stage=1),
    "stage2-accum2": dict(stage=2, accum_steps=2),
    "stage3": dict(stage=3),
    "stage1-bf16-loss-scale": dict(
        stage=1, param_dtype=jnp.bfloat16, loss_scale=zs.DynamicLossScale(2.0**10)
    ),
}


@pytest.mark.parametrize("setup", list(ONE_PIECE))
def test_an_inf_in_one_device_s_piece_only_is_skipped_by_every_device(setup, rng):
    """The only non-finite element of the mean gradient lies in one device's piece
    (the bad row is another device's): no other device sees it, yet every device
    must count the skip and change nothing (one verdict, agreed across devices)."""
    options = dict(ONE_PIECE[setup])
    stage, accum = options.pop("stage"), options.pop("accum_steps", 1)
    param_dtype = options.pop("param_dtype", None)
    mesh, params = make_mesh(8), one_piece_params(rng)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data", **options)
    state = zs.init_train_state(params, tx, mesh, stage=stage, param_dtype=param_dtype)
    loss_fn = (lambda p, b: one_piece_loss(zs.gather(p), b)) if stage == 3 else one_piece_loss
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage, accum_steps=accum)
    state, _ = step(state, one_piece_batch(rng))
    assert int(state.opt_state.skipped) == 0
    for skips, (row, column) in enumerate(BAD_ELEMENTS, start=1):
        batch = one_piece_batch(rng, row, column)
        check_one_piece_batch(params, batch, column)
        before = shards(state)
        state, metrics = step(state, batch)
        assert not np.isfinite(float(metrics["grad_norm"]))
        assert_skipped_everywhere(before, shards(state), skips)
    assert_replicas_identical(state)


def test_an_inf_in_one_device_s_piece_only_in_a_hand_written_shard_map(rng):
    """The same in a user's shard_map without varying types (``check_vma=False``), where
    nothing would stop a verdict local to each device from compiling."""
    mesh, params = make_mesh(8), one_piece_params(rng)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    specs = tx.state_specs(params, 8)
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)

    def step(p, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(one_piece_loss)(p, batch), opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(jax.P(), specs, jax.P("data")),
            out_specs=(jax.P(), specs),
            check_vma=False,
        )
    )
    place = lambda b: jax.device_put(b, jax.NamedSharding(mesh, jax.P("data")))
    state = step(params, opt_state, place(one_piece_batch(rng)))
    assert int(state[1].skipped) == 0
    for skips, (row, column) in enumerate(BAD_ELEMENTS, start=1):
        batch = one_piece_batch(rng, row, column)
        check_one_piece_batch(params, batch, column)
        before = shards(state)
        state = step(*state, place(batch))
        assert_skipped_everywhere(before, shards(state), skips)
