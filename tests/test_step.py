"""make_train_step / init_train_state: metrics, donation, compilation, bad input."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, make_mesh

import zeroshard as zs


@pytest.fixture
def setup(rng):
    params, mesh = awkward_params(rng), make_mesh(8)
    tx = zs.sharded(optax.adam(1e-2), axis_name="data")
    return params, mesh, tx, batches(rng, 3)


def test_metrics_are_global_loss_and_unclipped_grad_norm(rng):
    params, mesh, data = awkward_params(rng), make_mesh(8), batches(rng, 1)
    clip = zs.clip_by_global_norm(1e-3, axis_name="data")
    tx = zs.sharded(optax.chain(clip, optax.sgd(0.1)), axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    state, metrics = zs.make_train_step(awkward_loss, tx, mesh)(state, data[0])
    loss, grads = jax.value_and_grad(awkward_loss)(params, data[0])
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-6)
    assert float(metrics["grad_norm"]) > 100 * 1e-3  # reported before clipping


def test_has_aux_is_averaged_over_devices(setup):
    params, mesh, tx, data = setup

    def loss_fn(p, batch):
        return awkward_loss(p, batch), {"first_y": batch["y"][0, 0]}

    state = zs.init_train_state(params, tx, mesh)
    _, metrics = zs.make_train_step(loss_fn, tx, mesh, has_aux=True)(state, data[0])
    per_device_first = data[0]["y"][::2, 0]  # 16 rows over 8 devices: rows 0, 2, 4, ...
    np.testing.assert_allclose(metrics["aux"]["first_y"], per_device_first.mean(), rtol=1e-6)


def test_no_recompilation_and_state_is_donated(setup):
    params, mesh, tx, data = setup
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        old = state
        state, _ = train_step(state, batch)
        # Every buffer the step reads is donated (the old grad_norm is never read).
        donated = (old.step, old.params, old.opt_state.inner_state, old.opt_state.master)
        assert all(x.is_deleted() for x in jax.tree.leaves(donated))
    assert train_step.jitted._cache_size() == 1
    assert int(state.step) == len(data)


def test_without_donation_the_old_state_survives(setup):
    params, mesh, tx, data = setup
    state = zs.init_train_state(params, tx, mesh)
    new, _ = zs.make_train_step(awkward_loss, tx, mesh, donate=False)(state, data[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert int(new.step) == 1


def test_params_committed_to_one_device_are_accepted(setup):
    params, mesh, tx, data = setup
    params = jax.device_put(params, jax.devices()[0])
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    state, _ = train_step(state, data[0])
    state, _ = train_step(state, data[1])  # donating twice: no aliasing trouble
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_mesh_without_the_axis(setup):
    params, _, tx, _ = setup
    mesh = make_mesh(8, "batch")
    with pytest.raises(ValueError, match="mesh has no axis 'data'"):
        zs.make_train_step(awkward_loss, tx, mesh)
    with pytest.raises(ValueError, match="mesh has no axis 'data'"):
        zs.init_train_state(params, tx, mesh)


def test_axis_of_optimizer_and_step_differ(setup):
    _params, _, tx, _ = setup
    mesh = make_mesh(8, "batch")
    with pytest.raises(ValueError, match="built with axis_name='data'"):
        zs.make_train_step(awkward_loss, tx, mesh, axis_name="batch")


def test_plain_optax_is_refused_by_the_step(setup):
    params, mesh, _, _ = setup
    with pytest.raises(TypeError, match="zs.sharded"):
        zs.init_train_state(params, optax.adam(1e-3), mesh)


def test_batch_not_divisible_by_the_axis(setup):
    params, mesh, tx, data = setup
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    bad = jax.tree.map(lambda x: x[:12], data[0])
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 7\).*divisible by the 8"):
        train_step(state, bad)
    state, _ = train_step(state, data[0])  # the state is intact and usable
    assert int(state.step) == 1


def test_optimizer_mixing_leaves_fails_before_training(setup):
    params, mesh, _, _ = setup
    tx = zs.sharded(optax.apply_if_finite(optax.sgd(0.1), 3))
    with pytest.raises(ValueError, match="cannot run this inner optimizer exactly"):
        zs.init_train_state(params, tx, mesh)


def test_bf16_compute_copy_and_step_counter(setup):
    params, mesh, tx, data = setup
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    state, metrics = zs.make_train_step(awkward_loss, tx, mesh)(state, data[0])
    assert np.isfinite(float(metrics["loss"]))


def test_a_second_process_takes_every_compiled_program_from_the_persistent_cache(tmp_path):
    """Nothing in the plan, init or step defeats jax's persistent compilation cache (a
    host callback, a constant that differs per process): a second process compiles
    nothing, and trains to the same bits."""
    worker = pathlib.Path(__file__).with_name("cache_worker.py")
    run = lambda: json.loads(
        subprocess.run(
            [sys.executable, str(worker), str(tmp_path / "cache")],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout.splitlines()[-1]
    )
    first, second = run(), run()
    assert first["misses"] >= 2 and first["hits"] == 0  # at least init and the step
    assert (second["hits"], second["misses"]) == (first["misses"], 0)
    assert second["weights"] == first["weights"]
