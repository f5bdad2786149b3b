"""zs.sharded as an optax transformation: init anywhere, update in a user's shard_map,
the elementwise guard, and clear errors."""

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
    make_mesh,
    reference_run,
)
from jax.sharding import PartitionSpec as P

import zeroshard as zs


def test_update_in_a_hand_written_shard_map_loop(rng):
    """init inside shard_map; apply_updates gives the make_train_step weights.

    ``p + (new - p)`` is exact while a weight stays within a factor two of its old
    value (Sterbenz); otherwise it is off by one rounding, so allow one ulp per step.
    """
    n, params, data = 4, awkward_params(rng), batches(rng, 3)
    mesh = make_mesh(n)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    specs = tx.state_specs(params, n)

    def init(p):
        state = tx.init(p)
        assert state.inner_state[0].mu["dense"]["w"].shape == (1, -(-91 // n))  # local piece
        return state

    def step(p, opt_state, batch):
        grads = jax.grad(awkward_loss)(jax.lax.pcast(p, "data", to="varying"), batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    )
    p = params
    for batch in data:
        p, opt_state = step(p, opt_state, jax.device_put(batch, jax.NamedSharding(mesh, P("data"))))

    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        state, _ = train_step(state, batch)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_max_ulp(a, b, maxulp=len(data))
    assert_trees_close(p, reference_run(awkward_loss, optax.adamw(1e-2), params, data), 1e-5)


def test_init_on_shape_dtype_structs_under_a_mesh(rng):
    params = awkward_params(rng)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    mesh = make_mesh(8)
    tx = zs.sharded(optax.adam(1e-3), axis_name="data")
    with jax.set_mesh(mesh):
        abstract = jax.eval_shape(tx.init, structs)
        live = tx.init(params)
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(live), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.sharding.spec == b.sharding.spec
    mu = live.inner_state[0].mu["dense"]["w"]
    assert mu.shape == (1, 8 * 12) and mu.sharding.spec == P(None, "data")


def test_masks_by_rank_select_the_same_leaves(rng):
    """Pieces keep their leaf's rank, so the usual `ndim > 1` weight-decay mask works."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    make = lambda: optax.adamw(1e-2, weight_decay=0.5, mask=mask)
    params, data = awkward_params(rng), batches(rng, 3)
    expected = reference_run(awkward_loss, make(), params, data)
    mesh = make_mesh(8)
    tx = zs.sharded(make(), axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    train_step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        state, _ = train_step(state, batch)
    assert_trees_close(state.params, expected, 1e-5)


def per_leaf_normalise():
    """A hand-written transform that mixes elements: no name list could know it."""
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: x / jnp.sqrt(jnp.sum(x * x)), u), s),
    )


def square_updates():
    return optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(jnp.square, u), s)
    )


big = {"w": jnp.ones((256, 300)), "b": jnp.ones(300)}
REFUSED = {  # they combine several leaves other than by sums
    "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.1), 3),
}
OWNED = {  # name: (optimizer, the leaves that need whole tensors)
    # Per-leaf norms and RMS are sums: the leaves stay sliced, the sums are made whole.
    "lamb": (lambda: optax.lamb(1e-3), set()),
    "lars": (lambda: optax.lars(1e-3), set()),
    "novograd": (lambda: optax.novograd(1e-3), set()),
    "scale_by_trust_ratio": (lambda: optax.scale_by_trust_ratio(), set()),
    "clip_by_block_rms": (lambda: optax.clip_by_block_rms(0.1), set()),
    "hand_written_per_leaf_norm": (per_leaf_normalise, set()),
    # Norms per row or column, factored moments, matrix products, shape-based masks.
    "adaptive_grad_clip": (lambda: optax.adaptive_grad_clip(0.1), {"w"}),
    "factored_adafactor": (lambda: optax.adafactor(1e-3), {"w"}),
    "muon": (lambda: optax.contrib.muon(1e-3), {"w"}),
    "shape_mask": (
        lambda: optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.shape[0] == 256, p)),
        {"w"},
    ),
}
ACCEPTED = {
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adabelief": lambda: optax.adabelief(1e-3),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    "schedule": lambda: optax.adam(optax.cosine_decay_schedule(1e-3, 100)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    "zs_clip_chain": lambda: optax.chain(
        zs.clip_by_global_norm(1.0, axis_name="data"), optax.adamw(1e-3)
    ),
    "optax.clip_by_global_norm": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-3)
    ),
    "hand_written_elementwise": square_updates,
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_non_elementwise_inner_is_refused(name):
    tx = zs.sharded(REFUSED[name](), axis_name="data")
    with jax.set_mesh(make_mesh(8)), pytest.raises(ValueError, match="zs.sharded"):
        jax.eval_shape(tx.init, big)


@pytest.mark.parametrize("name", sorted(OWNED))
def test_leaves_that_need_whole_tensors_are_owned(name):
    make, expected = OWNED[name]
    tx = zs.sharded(make(), axis_name="data")
    with jax.set_mesh(make_mesh(8)):
        jax.eval_shape(tx.init, big)
    layout = tx.plan(big, 8).layout
    # (owned whole, or, where their rows divide by the devices, blocked: see zeroshard.core.blocks)
    owned = {s.path[2:-2] for s in layout.slots if s.placement in ("owned", "blocked")}
    assert owned == expected


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_elementwise_inner_is_accepted(name):
    tx = zs.sharded(ACCEPTED[name](), axis_name="data")
    with jax.set_mesh(make_mesh(8)):
        jax.eval_shape(tx.init, big)
    assert not any(s.owned for s in tx.plan(big, 8).layout.slots)


def test_error_names_the_offending_operation():
    tx = zs.sharded(optax.apply_if_finite(optax.sgd(0.1), 3))
    with jax.set_mesh(make_mesh(8)), pytest.raises(ValueError) as e:
        tx.init(big)
    message = str(e.value)
    assert "`concatenate`" in message and "_conditionality.py" in message, message
    assert "['b'], ['w']" in message and "skip_nonfinite" in message, message


def test_clear_errors_on_bad_trees():
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    with jax.set_mesh(make_mesh(8)):
        with pytest.raises(ValueError, match="empty parameter tree"):
            tx.init({})
        with pytest.raises(TypeError, match=r"\['step'\].*int32"):
            tx.init({"w": jnp.ones(3), "step": jnp.int32(0)})


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match=r"unknown options \['axis'\]"):
        zs.sharded(optax.sgd(0.1), axis="data")


def test_init_without_a_mesh_says_how_to_fix():
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    with pytest.raises(ValueError, match="set_mesh"):
        tx.init({"w": jnp.ones(3)})


def test_update_outside_shard_map_takes_the_mean_gradient():
    """Outside shard_map (eagerly here; in a jax.jit in tests/test_dropin.py) the
    gradient is the mean already: the update is plain optax's."""
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    params, grads = {"w": jnp.arange(3.0)}, {"w": jnp.asarray([1.0, -2.0, 0.5])}
    with jax.set_mesh(make_mesh(8)):
        state = tx.init(params)
        updates, _ = tx.update(grads, state, params)
    plain = optax.sgd(0.1)
    expected, _ = plain.update(grads, plain.init(params), params)
    # The new weights are plain optax's; updates are their difference from the old ones
    # (one rounding: new - old).
    new, want = optax.apply_updates(params, updates), optax.apply_updates(params, expected)
    np.testing.assert_array_equal(new["w"], want["w"])
    with pytest.raises(ValueError, match="needs `params`"):
        tx.update(params, state)


@pytest.mark.parametrize(
    "grads, match",
    [
        ({"w": jnp.ones((3, 4)), "b": jnp.ones(3)}, r"gradients leaf \['w'\] has shape \(3, 4\)"),
        ({"w": jnp.ones((4, 3))}, "tree structure"),
    ],
)
def test_mismatched_grads_and_params(grads, match):
    n, mesh = 8, make_mesh(8)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = zs.sharded(optax.sgd(0.1), axis_name="data")
    specs = tx.state_specs(params, n)
    with jax.set_mesh(mesh):
        state = tx.init(params)
    update = jax.shard_map(
        lambda g, s, p: tx.update(g, s, p)[0],
        mesh=mesh,
        in_specs=(P(), specs, P()),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match=match):
        jax.jit(update)(grads, state, params)
