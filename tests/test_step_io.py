"""zs.make_train_step with a per-step key (dropout), non-trainable model state
(BatchNorm-style statistics) and per-example aux, against plain optax on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, make_mesh, reference_run

import zeroshard as zs

D = 16


def make_params(rng):
    f = lambda *s: jnp.asarray(rng.normal(size=s) / s[0] ** 0.5, jnp.float32)
    return {"w": f(D, D), "out": f(D, 3)}


def data(rng, steps=3, size=32):
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(size, D), "y": f(size, 3)} for _ in range(steps)]


def dropout_loss(params, batch, key=None):
    """Dropout on the hidden layer when given a key; aux: the per-example mask, the
    per-example predictions and a scalar."""
    h = jnp.tanh(batch["x"] @ params["w"])
    mask = jnp.ones_like(h) if key is None else jax.random.bernoulli(key, 0.5, h.shape) * 2.0
    pred = (h * mask) @ params["out"]
    loss = jnp.mean((pred - batch["y"]) ** 2)
    return loss, {"mask": mask, "pred": pred, "scalar": jnp.mean(h)}


def train(loss_fn, params, batches, keys=None, n=8, accum_steps=1, **kw):
    mesh = make_mesh(n)
    tx = zs.sharded(optax.sgd(0.1, momentum=0.9), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, **kw)
    step = zs.make_train_step(loss_fn, tx, mesh, has_aux=True, accum_steps=accum_steps)
    outs = []
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch, None if keys is None else keys[i])
        outs.append(metrics)
    return state, tx, outs


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_per_example_aux_is_the_global_array(accum_steps, rng):
    params, batches = make_params(rng), data(rng)
    _, _, outs = train(dropout_loss, params, batches[:1], accum_steps=accum_steps)
    _, expected = dropout_loss(params, batches[0])
    aux = outs[0]["aux"]
    assert aux["pred"].shape == (32, 3) and aux["mask"].shape == (32, D)
    np.testing.assert_allclose(aux["pred"], expected["pred"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux["scalar"], expected["scalar"], rtol=1e-6)
    assert aux["scalar"].shape == ()


def test_without_a_key_the_run_is_plain_optax(rng):
    params, batches = make_params(rng), data(rng)
    loss = lambda p, b: dropout_loss(p, b)[0]
    expected = reference_run(loss, optax.sgd(0.1, momentum=0.9), params, batches)
    state, tx, _ = train(dropout_loss, params, batches)
    assert_trees_close(zs.to_optax_state(state, tx)[0], expected, rtol=1e-6)


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_dropout_masks_differ_per_device_and_runs_are_reproducible(accum_steps, rng):
    params, batches = make_params(rng), data(rng)
    batches = [dict(b, x=jnp.ones_like(b["x"])) for b in batches]  # the same rows everywhere
    keys = [jax.random.fold_in(jax.random.key(0), i) for i in range(len(batches))]
    a, _, outs = train(dropout_loss, params, batches, keys, accum_steps=accum_steps)
    masks = np.asarray(outs[0]["aux"]["mask"]).reshape(8 * accum_steps, -1)
    assert len({m.tobytes() for m in masks}) == len(masks)  # every device, micro-batch differs
    b, _, _ = train(dropout_loss, params, batches, keys, accum_steps=accum_steps)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)  # the same key: bit-identical
    other = [jax.random.fold_in(k, 1) for k in keys]
    c, _, _ = train(dropout_loss, params, batches, other, accum_steps=accum_steps)
    assert not np.array_equal(a.params["w"], c.params["w"])


def norm_loss(params, batch, model_state):
    """A batch-norm-like layer: normalises with the batch mean and keeps a running mean
    (per device: its own rows; the step averages the running mean over devices)."""
    h = batch["x"] @ params["w"]
    mean = jnp.mean(h, axis=0)
    new = {"running_mean": 0.9 * model_state["running_mean"] + 0.1 * mean}
    loss = jnp.mean(((h - mean) @ params["out"] - batch["y"]) ** 2)
    return loss, new


def test_model_state_is_averaged_and_checkpointed(rng, tmp_path):
    params, batches = make_params(rng), data(rng)
    model_state = {"running_mean": jnp.zeros(D)}
    mesh = make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    state = zs.init_train_state(params, tx, mesh, model_state=model_state)
    step = zs.make_train_step(norm_loss, tx, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    # Independently: per-device means of the rows, averaged, in a plain loop.
    ref_params, running = params, np.zeros(D)
    for batch in batches:
        blocks = np.asarray(batch["x"] @ ref_params["w"]).reshape(8, 4, D)
        running = 0.9 * running + 0.1 * blocks.mean(axis=1).mean(axis=0)

        def per_device(p, rows):
            h = rows["x"] @ p["w"]
            return jnp.mean(((h - jnp.mean(h, axis=0)) @ p["out"] - rows["y"]) ** 2)

        parts = [jax.tree.map(lambda x, i=i: x[4 * i : 4 * i + 4], batch) for i in range(8)]
        grads = [jax.grad(per_device)(ref_params, part) for part in parts]
        mean = jax.tree.map(lambda *g: sum(g) / 8, *grads)
        ref_params = jax.tree.map(lambda p, g: p - 0.1 * g, ref_params, mean)
    shards = state.model_state["running_mean"].addressable_shards
    assert all(np.array_equal(s.data, shards[0].data) for s in shards)  # identical everywhere
    np.testing.assert_allclose(state.model_state["running_mean"], running, rtol=1e-5, atol=1e-7)
    assert_trees_close(state.params, ref_params, rtol=1e-6)

    with zs.CheckpointManager(str(tmp_path / "ckpt"), tx) as ckpt:
        ckpt.save(state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(make_mesh(4), like=params, model_state=model_state)
        np.testing.assert_array_equal(
            restored.model_state["running_mean"], state.model_state["running_mean"]
        )
        with pytest.raises(ValueError, match="saved with a model_state"):
            ckpt.restore(make_mesh(4), like=params)
