"""Optimizers that need whole tensors: owned leaves give plain optax's numbers.

Every configuration of optax's own optimizer list (the one ``optax/_src/alias_test.py``
tests, optax 0.2.8) and ``optax.contrib.muon`` run under ``zs.sharded`` and match plain
optax on one device on the global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, make_mesh
from jax.sharding import PartitionSpec as P

import zeroshard as zs

# optax/_src/alias_test.py's _OPTIMIZERS_UNDER_TEST (optax 0.2.8): name and kwargs.
ALIAS_LIST = [
    ("adabelief", {"learning_rate": 1e-2}),
    ("adadelta", {"learning_rate": 0.1}),
    ("adadelta", {}),
    ("adafactor", {"learning_rate": 5e-3}),
    ("adafactor", {}),
    ("adagrad", {"learning_rate": 1.0}),
    ("adam", {"learning_rate": 1e-1}),
    ("adamax", {"learning_rate": 1e-1}),
    ("adamaxw", {"learning_rate": 1e-1}),
    ("adamw", {"learning_rate": 1e-1}),
    ("adan", {"learning_rate": 1e-1}),
    ("amsgrad", {"learning_rate": 1e-1}),
    ("fromage", {"learning_rate": 5e-3}),
    ("lamb", {"learning_rate": 1e-3}),
    ("lars", {"learning_rate": 1.0}),
    ("lion", {"learning_rate": 1e-2, "weight_decay": 1e-4}),
    ("nadam", {"learning_rate": 1e-2}),
    ("nadamw", {"learning_rate": 1e-2}),
    ("noisy_sgd", {"learning_rate": 1e-3, "eta": 1e-4, "key": 0}),
    ("novograd", {"learning_rate": 1e-3}),
    ("optimistic_adam", {"learning_rate": 2e-3}),
    ("optimistic_adam_v2", {"learning_rate": 2e-3}),
    ("optimistic_gradient_descent", {"learning_rate": 2e-3, "alpha": 0.7, "beta": 0.1}),
    ("polyak_sgd", {"max_learning_rate": 1.0}),
    ("radam", {"learning_rate": 5e-3}),
    ("rmsprop", {"learning_rate": 5e-3}),
    ("rmsprop", {"learning_rate": 5e-3, "momentum": 0.9}),
    ("rprop", {"learning_rate": 1e-1}),
    ("sgd", {"learning_rate": 1e-3, "momentum": 0.9}),
    ("sign_sgd", {"learning_rate": 1e-1}),
    ("signum", {"learning_rate": 1e-2}),
    ("sm3", {"learning_rate": 1.0}),
    ("yogi", {"learning_rate": 1e-1}),
]
CONFIGS = {f"{name}{i}": (name, kw) for i, (name, kw) in enumerate(ALIAS_LIST)}
# Those with owned leaves or global sums run at every N; the elementwise rest at N = 8
# (and at other N in test_parity.py).
WHOLE = ("adafactor", "fromage", "lamb", "lars", "noisy_sgd", "novograd", "polyak_sgd", "sm3")
CASES = [(c, 8) for c in CONFIGS] + [
    (c, n) for c, (name, _) in CONFIGS.items() if name in WHOLE for n in (3, 2)
]
# Relative L2 error per leaf after a few steps: ~1e-7 from summation order; a wrong
# placement (a norm or a factored moment of a slice) gives ~1e-1.
RTOL = 1e-5


def alias_params():
    params = awkward_params(np.random.default_rng(0))
    params["scale"] = params["scale"].reshape(1)  # optax's sm3 cannot take a scalar
    return params


def relative_errors(actual, expected, initial):
    """Per leaf, the L2 error over the leaf's scale: the larger of its expected and its
    initial norm (an update that cancels a weight leaves rounding of the weight's size)."""
    return {
        jax.tree_util.keystr(path): float(
            np.linalg.norm(a - e) / max(np.linalg.norm(e), np.linalg.norm(x), 1e-30)
        )
        for (path, a), e, x in zip(
            jax.tree_util.tree_leaves_with_path(actual),
            jax.tree.leaves(expected),
            jax.tree.leaves(initial),
            strict=True,
        )
    }


def reference(inner, params, data, loss_fn, parts=1):
    """Plain optax on one device, with the loss as ``value=`` (polyak_sgd needs it).

    The gradient is the mean of those of ``parts`` equal parts of the batch: the sum
    data parallelism on that many devices computes (optimizers that normalise by a
    nearly cancelled gradient amplify a different summation order; pitfall 15).
    """

    def value_and_grad(p, batch):
        split = [jax.tree.map(lambda x, k=k: jnp.split(x, parts)[k], batch) for k in range(parts)]
        out = [jax.value_and_grad(loss_fn)(p, b) for b in split]
        return jax.tree.map(lambda *xs: sum(xs) / parts, *out)

    @jax.jit
    def step(p, s, batch):
        loss, grads = value_and_grad(p, batch)
        updates, s = inner.update(grads, s, p, value=loss)
        return optax.apply_updates(p, updates), s

    p, s = params, inner.init(params)
    for batch in data:
        p, s = step(p, s, batch)
    return p


def hand_written_loop(tx, params, data, n, loss_fn):
    """zs.sharded in a user's own shard_map step (passing ``value=``)."""
    mesh = make_mesh(n)
    specs = tx.state_specs(params, n)

    def step(p, s, batch):
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), batch)
        updates, s = tx.update(grads, s, p, value=jax.lax.pmean(loss, "data"))
        return optax.apply_updates(p, updates), s

    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    )
    with jax.set_mesh(mesh):
        s = tx.init(params)
    p = params
    for batch in data:
        p, s = step(p, s, jax.device_put(batch, jax.NamedSharding(mesh, P("data"))))
    return p


@pytest.fixture(scope="module")
def alias_setup():
    params, data = alias_params(), batches(np.random.default_rng(1), 2, size=24)
    return params, data, {}


@pytest.mark.parametrize(("config", "n"), CASES)
def test_optax_alias_list_matches_plain_optax(config, n, alias_setup):
    params, data, references = alias_setup
    name, kwargs = CONFIGS[config]
    inner = optax.with_extra_args_support(getattr(optax, name)(**kwargs))
    if (config, n) not in references:
        references[config, n] = reference(inner, params, data, awkward_loss, n)
    got = hand_written_loop(zs.sharded(inner), params, data, n, awkward_loss)
    errors = relative_errors(got, references[config, n], params)
    assert max(errors.values()) < RTOL, errors


def test_global_norm_clipping_needs_no_source_change(alias_setup):
    """optax.clip_by_global_norm sums over several leaves: the sum is made global."""
    params, data, _ = alias_setup
    inner = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    tx = zs.sharded(inner)
    assert not tx.plan(params, 8).layout.has_owned
    errors = relative_errors(
        hand_written_loop(tx, params, data, 8, awkward_loss),
        reference(optax.with_extra_args_support(inner), params, data, awkward_loss, 8),
        params,
    )
    assert max(errors.values()) < RTOL, errors


def test_the_guard_still_refuses_what_no_placement_makes_exact():
    params = alias_params()

    def max_over_leaves(u, s, p=None):  # scales every leaf by the largest element anywhere
        top = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(u)]))
        return jax.tree.map(lambda x: x / top, u), s

    for inner in (
        optax.apply_if_finite(optax.sgd(0.1), 3),
        optax.GradientTransformation(lambda p: optax.EmptyState(), max_over_leaves),
    ):
        with jax.set_mesh(make_mesh(8)), pytest.raises(ValueError, match="several parameters"):
            jax.eval_shape(zs.sharded(inner).init, params)
    forced = zs.sharded(optax.lamb(1e-3), placement=lambda path, leaf: "sliced")
    with jax.set_mesh(make_mesh(8)), pytest.raises(ValueError, match="forces .* sliced"):
        jax.eval_shape(forced.init, params)


def test_forced_placement_and_balance():
    params = alias_params()
    tx = zs.sharded(
        optax.adam(1e-3), placement={**jax.tree.map(lambda _: None, params), "out": {"w": "owned"}}
    )
    layout = tx.plan(params, 8).layout
    assert [s.path for s in layout.slots if s.owned] == ["['out']['w']"]
    errors = relative_errors(
        hand_written_loop(tx, params, batches(np.random.default_rng(2), 2), 8, awkward_loss),
        reference(
            optax.with_extra_args_support(optax.adam(1e-3)),
            params,
            batches(np.random.default_rng(2), 2),
            awkward_loss,
            8,
        ),
        params,
    )
    assert max(errors.values()) < RTOL, errors
