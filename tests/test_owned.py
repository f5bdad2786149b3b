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
from zeroshard.core.state_kinds import ReplicatedState

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
    p = jax.device_put(params, jax.NamedSharding(mesh, P()))  # typed as the step returns it
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
    assert not any(s.owned for s in tx.plan(params, 8).layout.slots)
    errors = relative_errors(
        hand_written_loop(tx, params, data, 8, awkward_loss),
        reference(optax.with_extra_args_support(inner), params, data, awkward_loss, 8),
        params,
    )
    assert max(errors.values()) < RTOL, errors


@pytest.mark.parametrize("n", [8, 3])
def test_zeroshard_clipping_is_summed_once(n, alias_setup):
    """zs.clip_by_global_norm sums its partial squares (from 0.0) and psums them itself:
    the update must not sum them over the devices a second time."""
    params, data, _ = alias_setup
    inner = optax.chain(zs.clip_by_global_norm(0.05, axis_name="data"), optax.lamb(1e-2))
    plain = optax.chain(optax.clip_by_global_norm(0.05), optax.lamb(1e-2))
    errors = relative_errors(
        hand_written_loop(zs.sharded(inner), params, data, n, awkward_loss),
        reference(optax.with_extra_args_support(plain), params, data, awkward_loss, n),
        params,
    )
    assert max(errors.values()) < RTOL, errors


# Per-leaf norms, RMS and means: the leaves stay sliced and their sums are made whole
# (summed over the devices, padding left out, a mean divided by the leaf's size).
PER_LEAF_SUMS = {
    "trust_ratio": lambda: optax.chain(
        optax.scale_by_adam(), optax.scale_by_trust_ratio(), optax.scale(-1e-2)
    ),
    "block_rms_clipping": lambda: optax.chain(optax.clip_by_block_rms(1e-3), optax.sgd(0.1)),
    "param_block_rms": lambda: optax.chain(optax.scale_by_param_block_rms(), optax.sgd(0.1)),
    "adafactor_unfactored": lambda: optax.adafactor(1e-2, factored=False),
    # A clean term inside the norm: added once, not once per device.
    "norm_with_a_constant_inside": lambda: optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: x / jnp.sqrt(jnp.sum(x * x) + 1.0), u), s),
    ),
    "chained_with_global_clipping": lambda: optax.chain(
        optax.clip_by_global_norm(0.05), optax.lamb(1e-2)
    ),
}


@pytest.mark.parametrize("n", [8, 3])
@pytest.mark.parametrize("name", sorted(PER_LEAF_SUMS))
def test_per_leaf_sums_keep_leaves_sliced(name, n, alias_setup):
    params, data, _ = alias_setup
    inner = optax.with_extra_args_support(PER_LEAF_SUMS[name]())
    tx = zs.sharded(inner)
    assert not any(s.owned for s in tx.plan(params, n).layout.slots)
    errors = relative_errors(
        hand_written_loop(tx, params, data, n, awkward_loss),
        reference(inner, params, data, awkward_loss, n),
        params,
    )
    assert max(errors.values()) < RTOL, errors


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_a_step_traced_again_reuses_the_inner_update(name):
    """The inner update is traced (and, with global sums: lamb's norms, tagged and
    evaluated) once per type of its arguments: the step traced again for another batch
    size reuses it instead of running optax's Python again."""
    calls, inner = [], getattr(optax, name)(1e-2)
    counted = lambda *args, **kw: (calls.append(1), inner.update(*args, **kw))[1]
    tx = zs.sharded(optax.GradientTransformation(inner.init, counted))
    mesh, rng = make_mesh(8), np.random.default_rng(0)
    state = zs.init_train_state(awkward_params(rng), tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    before = len(calls)  # the plan's analysis traced it already
    state, _ = step(state, batches(rng, 1, size=24)[0])
    first = len(calls)
    step(state, batches(rng, 1, size=16)[0])  # another shape: the step is traced again
    assert first > before and len(calls) == first


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


def transformer_params(rng, vocab=512, d=32, layers=2):
    """A transformer's leaves: one large embedding, attention and MLP matrices, norms."""
    f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-1]), jnp.float32)
    block = lambda: {
        "attn": {k: f(d, d) for k in ("wq", "wk", "wv", "wo")},
        "mlp": {"w1": f(d, 3 * d), "b1": jnp.zeros(3 * d), "w2": f(3 * d, d)},
        "norm": jnp.ones(d),
    }
    return {"embed": f(vocab, d), "blocks": [block() for _ in range(layers)], "norm": jnp.ones(d)}


def transformer_loss(params, batch):
    """Next-token cross-entropy of a small causal transformer (tied embedding). Works
    in every stage: zs.gather leaves full arrays as they are."""
    p = zs.gather(params) if any(map(zs.Piece.__instancecheck__, _leaves(params))) else params
    tokens = batch["tokens"]
    rms = lambda x, g: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g
    x = p["embed"][tokens[:, :-1]]
    t = x.shape[1]
    for b in p["blocks"]:
        h = rms(x, b["norm"])
        a = b["attn"]
        q, k, v = h @ a["wq"], h @ a["wk"], h @ a["wv"]
        logits = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        x = x + jax.nn.softmax(logits) @ v @ a["wo"]
        m = b["mlp"]
        x = x + jax.nn.gelu(rms(x, b["norm"]) @ m["w1"] + m["b1"]) @ m["w2"]
    logits = rms(x, p["norm"]) @ p["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, zs.Piece))


def token_batches(rng, steps, size=48, length=9, vocab=512):
    return [{"tokens": jnp.asarray(rng.integers(0, vocab, (size, length)))} for _ in range(steps)]


WHOLE_TENSOR = {
    "muon": lambda: optax.contrib.muon(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    "novograd": lambda: optax.novograd(1e-2),
    "fromage": lambda: optax.fromage(1e-2),
}


@pytest.fixture(scope="module")
def transformer():
    rng = np.random.default_rng(3)
    return transformer_params(rng), token_batches(rng, 3)


@pytest.mark.parametrize("name", sorted(WHOLE_TENSOR))
def test_whole_tensor_optimizers_on_a_transformer(name, transformer):
    params, data = transformer
    inner = WHOLE_TENSOR[name]()
    n, mesh = 8, make_mesh(8)
    tx = zs.sharded(inner)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(transformer_loss, tx, mesh)
    for batch in data:
        state, _ = step(state, batch)
    expected = reference(optax.with_extra_args_support(inner), params, data, transformer_loss, n)
    errors = relative_errors(state.params, expected, params)
    assert max(errors.values()) < RTOL, errors

    # Bytes per device: what zs.estimate_memory reports, within its imbalance of 1/N.
    measured = zs.state_bytes_per_device(
        (state.opt_state.inner_state, state.opt_state.master, state.opt_state.owned)
    )
    plain = zs.state_bytes_per_device(jax.eval_shape(inner.init, params))
    est = zs.estimate_memory(params, n, stage=1, param_dtype=jnp.float32, optimizer=inner)
    print(
        f"{name}: {measured:,} B/device vs plain/N {plain / n:,.0f} B, imbalance "
        f"{est.imbalance:.3f} (bytes), {est.update_imbalance:.3f} (update cost)"
    )
    assert measured == est.optimizer_state + est.master
    # Beyond plain/N: replicated leaves (counts) and the padding of sliced leaves.
    plan = tx.plan(params, n)
    replicated = plan.state_treedef.flatten_up_to(jax.eval_shape(inner.init, params))
    slack = sum(
        x.size * x.dtype.itemsize
        for k, x in enumerate(replicated)
        if type(plan.state_kinds[k]) is ReplicatedState
    )
    slack += 4 * n * len(plan.layout.slots)
    assert measured <= (plain / n + slack) * est.imbalance


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_stages_accumulation_and_a_restore_on_another_device_count(name, transformer, tmp_path):
    params, data = transformer
    inner = WHOLE_TENSOR[name]()
    tx = zs.sharded(inner)
    expected = reference(optax.with_extra_args_support(inner), params, data, transformer_loss, 8)
    for stage, n in ((2, 8), (3, 4)):
        mesh = make_mesh(n)
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(transformer_loss, tx, mesh, stage=stage, accum_steps=2)
        for batch in data:
            state, _ = step(state, batch)
        params_now = zs.to_optax_state(state, tx)[0]
        errors = relative_errors(params_now, expected, params)
        assert max(errors.values()) < RTOL, (stage, errors)

    for (stage, n), got in resumed_elsewhere(transformer_loss, tx, params, data, tmp_path):
        errors = relative_errors(got, expected, params)
        assert max(errors.values()) < RTOL, (stage, n, errors)


def resumed_elsewhere(loss_fn, tx, params, data, directory):
    """Trains one step on 8 devices and saves it; then resumes on 3 devices (stage 1)
    and on 2 (stage 3) for the other batches. Yields ``((stage, n), final weights)``."""
    mesh = make_mesh(8)
    state = zs.init_train_state(params, tx, mesh)
    state, _ = zs.make_train_step(loss_fn, tx, mesh)(state, data[0])
    with zs.CheckpointManager(directory, tx) as ckpt:
        ckpt.save(state, force=True)
    for stage, n in ((1, 3), (3, 2)):
        mesh = make_mesh(n)
        state = zs.CheckpointManager(directory, tx).restore(mesh, like=params, stage=stage)
        step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
        for batch in data[1:]:
            state, _ = step(state, batch)
        yield (stage, n), zs.to_optax_state(state, tx)[0]


def test_collectives_are_those_of_an_elementwise_optimizer(transformer):
    """Owned leaves move with one reduce-scatter and one all-gather per bucket: the same
    kinds as adamw's, with the bytes of the most loaded device's row. (Every matrix is
    forced owned: left to itself, zeroshard updates the larger ones on blocks, with an
    all-reduce per Newton-Schulz iteration and all-to-alls for blocks of columns.)"""
    params, data = transformer
    mesh, found = make_mesh(8), {}
    owned = lambda path, x: "owned" if x.ndim == 2 else None
    for name, inner in (("adamw", optax.adamw(1e-2)), ("muon", optax.contrib.muon(1e-2))):
        tx = zs.sharded(inner, placement=owned if name == "muon" else None)
        state = zs.init_train_state(params, tx, mesh)
        hlo = zs.make_train_step(transformer_loss, tx, mesh).lower(state, data[0]).compile()
        found[name] = zs.summarize(zs.compiled_collectives(hlo.as_text(), mesh=mesh))
        layout = tx.plan(params, 8).layout
    print({k: {kind: v["count"] for kind, v in s.items()} for k, s in found.items()})
    assert set(found["muon"]) == set(found["adamw"])
    owned = sum(s.size for s in layout.slots if s.owned)
    width = sum(b.owned_width for b in layout.buckets)
    extra = 8 * width - owned  # padding to the most loaded device, per collective
    for kind in ("reduce-scatter", "all-gather"):
        got, base = found["muon"][kind]["bytes"], found["adamw"][kind]["bytes"]
        print(kind, got, base)
        assert got <= base + 4 * extra * (8 if kind == "all-gather" else 1)


def test_extra_arguments_and_loss_scaling_with_owned_leaves():
    """reduce_on_plateau's value= passes through; a loss scale unscales owned grads."""
    params, data = alias_params(), batches(np.random.default_rng(4), 3, size=16)
    inner = optax.chain(optax.lamb(1e-2), optax.contrib.reduce_on_plateau(patience=0))
    expected = reference(optax.with_extra_args_support(inner), params, data, awkward_loss, 8)
    errors = relative_errors(
        hand_written_loop(zs.sharded(inner), params, data, 8, awkward_loss), expected, params
    )
    assert max(errors.values()) < RTOL, errors

    mesh = make_mesh(8)
    tx = zs.sharded(optax.lamb(1e-2), loss_scale=zs.DynamicLossScale(initial=2.0**10))
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in data:
        state, _ = step(state, batch)
    expected = reference(
        optax.with_extra_args_support(optax.lamb(1e-2)), params, data, awkward_loss, 8
    )
    errors = relative_errors(state.params, expected, params)
    assert max(errors.values()) < RTOL, errors


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_factored_adafactor_at_real_sizes(skip_nonfinite):
    """Both dimensions >= 128, so Adafactor factors the matrices (a d = 32 tree never
    does): with non-finite skipping on, the stand-ins' factored moments (built from
    constants) must be typed like the state they replace in the conditional."""
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.05, jnp.float32)
    params = {"up": f(128, 256), "down": f(256, 128), "b": jnp.zeros(256)}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["up"] + p["b"]) @ p["down"] - b["y"]) ** 2)

    data = [{"x": f(32, 128) * 20, "y": f(32, 128) * 20} for _ in range(3)]
    mesh = make_mesh(8)
    # Forced owned: left to itself, zeroshard updates these two dominant matrices on
    # blocks of rows on every device (zeroshard.core.blocks), and no device sees a stand-in.
    owned = {"up": "owned", "down": "owned", "b": None}
    tx = zs.sharded(optax.adafactor(1e-2), skip_nonfinite=skip_nonfinite, placement=owned)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(loss, tx, mesh)
    for batch in data:
        state, _ = step(state, batch)
    slots = {s.path: s for s in tx.plan(params, 8).layout.slots}
    assert slots["['up']"].owned and slots["['down']"].owned  # factored: whole matrices
    expected = reference(optax.adafactor(1e-2), params, data, loss)
    for k in params:
        err = np.linalg.norm(state.params[k] - expected[k]) / np.linalg.norm(expected[k])
        assert err < 2e-5, (k, err)
