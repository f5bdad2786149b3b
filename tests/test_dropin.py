"""The one-line drop-in: programs zeroshard did not write, with only the optimizer line changed.

Each program is data-parallel on 8 devices as a JAX user writes it: parameters
replicated, the batch sharded over ``"data"``, the user's own ``jax.jit`` or
``nnx.jit`` step. The reference is the same program with plain optax on the same
devices; zeroshard's version changes the line that builds the optimizer and nothing
else. Then the parameters match per leaf, the optimizer state is 1/N per device, and
the parameters come back whole on every device.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import assert_trees_close, make_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_flax_programs import CNN, LinenCNN, MiniGPT, gpt_loss, mnist_like, token_batches

import zeroshard as zs
import zeroshard.flax as zf

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2),  # every leaf owned: whole-tensor norms
}


def auto_mesh(n=8):
    """The mesh of jit + NamedSharding data parallelism (Auto axes: the arrays a jitted
    step returns are usable outside any mesh context, as the tutorial's metrics need)."""
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))


def assert_leaves_close(actual, expected, rtol=1e-4):
    """Per leaf: the L2 norm of the difference is below ``rtol`` of the expected's."""
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(np.linalg.norm(b), 1e-12)
        assert np.linalg.norm(a - b) <= rtol * scale, jax.tree_util.keystr(path)


def assert_whole_everywhere(tree):
    for x in jax.tree.leaves(tree):
        assert x.sharding.is_fully_replicated, x.sharding
        assert all(s.data.shape == x.shape for s in x.addressable_shards)


def assert_one_nth(sharded_state, plain_state, n=8):
    """Optimizer bytes per device: the plain state's over ``n``, plus at most one
    padding element per leaf and piece and the replicated scalars."""
    plain = sum(x.nbytes for x in jax.tree.leaves(plain_state))
    leaves = len(jax.tree.leaves(plain_state))
    assert zs.state_bytes_per_device(sharded_state) <= plain / n + 8 * leaves + 64


# 1. A pure optax loop.


def optax_loop(tx, mesh, batches, params):
    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        opt_state = tx.init(params)
        for batch in batches:
            params, opt_state = step(params, opt_state, jax.device_put(batch, P("data")))
    return params, opt_state


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_pure_optax_loop(name, axis_type, rng):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
    params = {"w1": f(7, 13), "b1": f(13), "w2": f(13, 5)}
    batches = [{"x": f(32, 7), "y": f(32, 5)} for _ in range(3)]
    expected, plain_state = optax_loop(OPTIMIZERS[name](), mesh, batches, params)
    actual, state = optax_loop(zs.sharded(OPTIMIZERS[name]()), mesh, batches, params)  # the line
    assert_leaves_close(actual, expected)
    assert_whole_everywhere(actual)
    assert_one_nth(state, plain_state)  # lamb too: its norms are sums, its leaves sliced


INJECTED = {
    "sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
    "adam": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}


def set_rate_loop(tx, batches, params, place=lambda x: x, new_rate=None, at=2):
    """The user's jitted loop; before step ``at`` the learning rate is set to
    ``new_rate`` with ``optax.tree_utils.tree_set``, as optax documents."""

    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for i, batch in enumerate(batches):
        if i == at and new_rate is not None:
            opt_state = optax.tree_utils.tree_set(opt_state, learning_rate=jnp.asarray(new_rate))
            assert optax.tree_utils.tree_get(opt_state, "learning_rate") == new_rate
        params, opt_state = step(params, opt_state, place(batch))
    return params, opt_state


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(INJECTED))
def test_the_learning_rate_set_mid_run_with_optax_tree_set(name, stage, rng):
    """optax.tree_utils.tree_set / tree_get on the drop-in's state of
    optax.inject_hyperparams (was: "Too many leaves for PyTreeDef" from inside optax,
    which walked the state's layout key as leaves): the new rate is read back, kept
    by the steps, and the weights are plain optax's on one device, on the global
    batch, with the same rate set at the same step."""
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
    params = {"w1": f(16, 32), "b1": f(32), "w2": f(32, 8)}
    batches = [{"x": f(32, 16), "y": f(32, 8)} for _ in range(5)]
    new_rate = {"sgd": 0.4, "adam": 5e-2}[name]
    expected, _ = set_rate_loop(INJECTED[name](), batches, params, new_rate=new_rate)
    unchanged, _ = set_rate_loop(INJECTED[name](), batches, params)
    assert not np.allclose(expected["w1"], unchanged["w1"], rtol=1e-3)  # the rate matters
    mesh, tx = auto_mesh(), zs.sharded(INJECTED[name](), stage=stage)  # the line
    with jax.set_mesh(mesh):
        start = tx.shard_params(params) if stage == 3 else jax.device_put(params, P())
        place = lambda batch: jax.device_put(batch, P("data"))
        got, opt_state = set_rate_loop(tx, batches, start, place, new_rate)
    assert optax.tree_utils.tree_get(opt_state, "learning_rate") == new_rate
    assert_trees_close(got, expected, rtol=1e-5)


# 2. The Flax NNX MNIST tutorial, its metrics and its eval step.


def nnx_tutorial(make_optimizer, mesh, batches, swapped=False):
    """The tutorial's loop; ``swapped``: its train step is zeroshard's NNX step, and the
    metrics are updated from what that returns (the eval step stays as written)."""
    model = CNN(rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    optimizer = make_optimizer(model)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    def loss_fn(model, batch):
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]
        ).mean()
        return loss, logits

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    @nnx.jit
    def eval_step(model, metrics, batch):
        loss, logits = loss_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])

    if swapped:
        step = zf.nnx_train_step(loss_fn, mesh, has_aux=True)

        def train_step(model, optimizer, metrics, batch):
            out = step(model, optimizer, batch)
            metrics.update(loss=out["loss"], logits=out["aux"], labels=batch["label"])

    history = []
    place = (
        (lambda b: b) if swapped else lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))
    )
    for batch in batches[:-1]:
        model.train()
        train_step(model, optimizer, metrics, place(batch))
        history.append({k: float(v) for k, v in metrics.compute().items()})
        metrics.reset()
        model.eval()
        eval_step(model, metrics, place(batches[-1]))
        history.append({k: float(v) for k, v in metrics.compute().items()})
        metrics.reset()
    return model, optimizer, history


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_nnx_mnist_tutorial(name, rng):
    mesh = auto_mesh()
    batches = mnist_like(rng, steps=4)
    inner = OPTIMIZERS[name]
    if name == "adamw":
        # conv2's bias feeds BatchNorm, so its true gradient is zero and what it gets is
        # rounding, which differs between two compiled programs; Adam's default eps
        # divides that by its own size, into full-size steps of random sign. A larger
        # eps keeps Adam's per-element scaling everywhere else.
        inner = lambda: optax.adamw(1e-2, eps=1e-3, weight_decay=0.1)
    ref, ref_opt, expected = nnx_tutorial(
        lambda model: nnx.Optimizer(model, inner(), wrt=nnx.Param), mesh, batches
    )
    model, opt, history = nnx_tutorial(
        lambda model: nnx.Optimizer(model, zs.sharded(inner(), mesh=mesh), wrt=nnx.Param),
        mesh,
        batches,
    )
    for got, want in zip(history, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert_whole_everywhere(params)
    ref_params = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
    for p in (params, ref_params):  # a bias right before BatchNorm: zero gradient, rounding
        assert np.abs(np.asarray(p["conv2"].pop("bias"))).max() < 1e-5  # weights: ~0.1
    assert_leaves_close(params, ref_params)
    assert_one_nth(nnx.as_pure(opt.opt_state), nnx.as_pure(ref_opt.opt_state))


def test_the_nnx_mnist_tutorial_with_zeroshards_step(rng):
    """The train step swapped for zf.nnx_train_step on jax.make_mesh's default
    (Explicit) mesh; the metrics and the eval step as the tutorial writes them."""
    mesh, batches = make_mesh(8), mnist_like(rng, steps=3)
    make = lambda model: zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.05, momentum=0.9)), mesh)
    model, _, history = nnx_tutorial(make, mesh, batches, swapped=True)
    assert len(history) == 4
    for entry in history:
        assert 0 <= entry["accuracy"] <= 1 and np.isfinite(entry["loss"])
    assert_whole_everywhere(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_the_annotated_minigpt(rng):
    """The miniGPT example's sharding annotations over a "model" axis, on its own
    (data, model) mesh with the default (Explicit) axis types, under jax.set_mesh: in
    its own nnx.jit step, and with zeroshard's NNX step and the metrics it returns."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    batches, trained, states = token_batches(rng), [], []
    for make in (
        lambda: optax.sgd(0.1, momentum=0.9),
        lambda: zs.sharded(optax.sgd(0.1, momentum=0.9)),
    ):
        with jax.set_mesh(mesh):
            model = MiniGPT(rngs=nnx.Rngs(0))
            model.eval()  # dropout off
            optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)

            @nnx.jit
            def train_step(model, optimizer, batch):
                _, grads = nnx.value_and_grad(gpt_loss, has_aux=True)(model, batch)
                optimizer.update(model, grads)

            for batch in batches:
                train_step(model, optimizer, jax.device_put(batch, P("data")))
        assert model.output_layer.kernel[...].sharding.spec == P(None, "model")  # honoured
        trained.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        states.append(nnx.as_pure(optimizer.opt_state))
    with jax.set_mesh(mesh):  # the example's loop with zeroshard's step, metrics as written
        model = MiniGPT(rngs=nnx.Rngs(0))
        model.eval()
        optimizer = zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.1, momentum=0.9)), mesh)
        step = zf.nnx_train_step(gpt_loss, mesh, has_aux=True)
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
        for batch in batches:
            out = step(model, optimizer, jax.device_put(batch, P("data")))
            metrics.update(loss=out["loss"], logits=out["aux"], labels=batch[1])
        assert np.isfinite(float(metrics.compute()["loss"]))
        metrics.reset()
        assert model(batches[0][0][:1]).shape == (1, 8, 64)  # as its text generation calls it
    trained.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    for tree in trained:  # attention's key bias has a zero gradient: rounding only
        for block in range(2):
            bias = tree["transformer_blocks"]["layers"][block]["mha"]["key"].pop("bias")
            assert np.abs(np.asarray(bias)).max() < 1e-8
    assert_leaves_close(trained[1], trained[0])
    assert_leaves_close(trained[2], trained[0])
    assert_one_nth(states[1], states[0], n=8)  # 1/N over every device of the mesh


# 3. The Flax Linen MNIST example: TrainState.create and apply_gradients.


class TrainStateWithEMA(train_state.TrainState):
    """A user's subclass with an extra field (an EMA of the weights)."""

    ema: dict


def linen_example(tx, mesh, batches):
    model = LinenCNN()
    params = model.init(jax.random.key(0), batches[0]["image"])["params"]
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = TrainStateWithEMA.create(apply_fn=model.apply, params=params, tx=tx, ema=params)

    @jax.jit
    def apply_model(state, images, labels):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, images)
            one_hot = jax.nn.one_hot(labels, 10)
            return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot)), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return grads, loss, accuracy

    @jax.jit
    def update_model(state, grads):
        state = state.apply_gradients(grads=grads)
        ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema, state.params)
        return state.replace(ema=ema)

    losses = []
    for batch in batches:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        grads, loss, accuracy = apply_model(state, batch["image"], batch["label"])
        state = update_model(state, grads)
        losses += [float(loss), float(accuracy)]
    return state, losses


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_linen_mnist_example(name, rng):
    mesh = auto_mesh()
    batches = mnist_like(rng)
    expected, expected_losses = linen_example(OPTIMIZERS[name](), mesh, batches)
    state, losses = linen_example(zs.sharded(OPTIMIZERS[name](), mesh=mesh), mesh, batches)
    assert type(state) is TrainStateWithEMA
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_leaves_close(state.params, expected.params)
    assert_leaves_close(state.ema, expected.ema)
    assert_whole_everywhere(state.params)
    assert_one_nth(state.opt_state, expected.opt_state)


# Misuse.


def test_a_gradient_reduced_already_in_a_shard_map_is_refused():
    mesh = make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1))
    params = {"w": jnp.ones((8, 3))}
    with jax.set_mesh(mesh):
        opt_state = tx.init(params)

    def step(params, opt_state, x):  # no pcast: the gradient is all-reduced for us
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        return tx.update(grads, opt_state, params)

    specs = tx.state_specs(params, 8)
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"pcast.*|.*pcast"):
        jax.jit(step)(params, opt_state, x)


def test_no_mesh_known_is_a_clear_error():
    tx = zs.sharded(optax.sgd(0.1))
    with pytest.raises(ValueError, match="mesh=mesh"):
        tx.init({"w": jnp.ones(4)})


@pytest.mark.parametrize("stage", [1, 3])
def test_a_state_another_optimizer_made_is_refused(stage):
    """tx.update given the inner optimizer's own state (was: an AttributeError from
    inside zeroshard) names what it got and the fix."""
    mesh, tx = jax.make_mesh((8,), ("data",)), zs.sharded(optax.adam(1e-3), stage=stage)
    with jax.set_mesh(mesh):
        params = jax.device_put({"w": jnp.ones((8, 4))}, NamedSharding(mesh, P()))
        with pytest.raises(TypeError, match=r"ScaleByAdamState.*tx\.init\(params\)"):
            jax.jit(tx.update)(params, optax.adam(1e-3).init(params), params)


def test_a_mesh_that_disagrees_with_the_context_is_zeroshards_error():
    """zs.sharded(mesh=...) called under jax.set_mesh of another mesh (another shape,
    or one without the axis): zeroshard's error names both meshes, not shard_map's."""
    mesh, params = auto_mesh(), {"w": jnp.ones((8, 3))}
    tx = zs.sharded(optax.sgd(0.1), mesh=mesh)
    for other in (jax.make_mesh((4, 2), ("data", "model")), jax.make_mesh((8,), ("batch",))):
        with jax.set_mesh(other), pytest.raises(ValueError) as error:
            tx.init(params)
        message = str(error.value)
        assert "{'data': 8 (Auto)}" in message and repr(other.axis_names[-1]) in message
        assert "jax.set_mesh(mesh)" in message and "zs.sharded(inner, mesh=mesh)" in message
    with jax.set_mesh(mesh):  # the same mesh: no error
        opt_state = tx.init(params)
    with jax.set_mesh(jax.make_mesh((8,), ("batch",))), pytest.raises(ValueError, match="batch"):
        jax.jit(tx.update)(params, opt_state, params)


def test_an_optimizer_that_calls_back_into_the_model_is_refused(rng):
    """optax.lbfgs's zoom line search calls value_fn= on whole parameters inside its
    update: refused with zeroshard's reason, as a plain optax drop-in and through
    nnx.Optimizer (optimizer.update(model, grads, grad=, value=, value_fn=)), with no
    internal TypeError; a function given to any update is refused too."""
    mesh = auto_mesh()
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    why = r"requires value=, grad=, value_fn=.*line search.*Use plain optax"
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=why):
            nnx.Optimizer(model, zs.sharded(optax.lbfgs()), wrt=nnx.Param)
        with pytest.raises(ValueError, match=why):
            zs.sharded(optax.lbfgs()).init({"w": jnp.ones((4, 2))})
        params = {"w": jnp.ones((4, 2))}
        tx = zs.sharded(optax.sgd(0.1))
        opt_state = tx.init(params)
        value_fn = lambda p: jnp.sum(p["w"] ** 2)
        with pytest.raises(ValueError, match="value_fn= a function.*Use plain optax"):
            tx.update(params, opt_state, params, value_fn=value_fn)


def test_the_steps_pass_the_loss_as_value_and_name_any_other_required_argument():
    """optax.polyak_sgd's update requires value=: zeroshard's own step passes the step's
    mean loss, as plain optax's update(..., value=loss) on the global batch; an
    argument it cannot know (here foo=) gets zeroshard's error with the fix."""
    mesh, inner = make_mesh(8), optax.polyak_sgd(max_learning_rate=1.0)
    loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
    batches = [
        {k: jnp.asarray(rng.normal(size=(16, n)), jnp.float32) for k, n in (("x", 3), ("y", 2))}
        for _ in range(3)
    ]
    tx = zs.sharded(inner)
    state, step = zs.init_train_state(params, tx, mesh), zs.make_train_step(loss_fn, tx, mesh)
    expected, opt_state = params, inner.init(params)
    for batch in batches:
        state, _ = step(state, batch)
        loss, grads = jax.value_and_grad(loss_fn)(expected, batch)
        updates, opt_state = inner.update(grads, opt_state, expected, value=loss)
        expected = optax.apply_updates(expected, updates)
    assert_trees_close(state.params, expected, rtol=1e-6)

    def update(updates, state, params=None, *, foo):
        return updates, state

    needs_foo = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = zs.sharded(needs_foo)
    state, step = zs.init_train_state(params, tx, mesh), zs.make_train_step(loss_fn, tx, mesh)
    with pytest.raises(TypeError, match=r"requires foo=\.\.\.; pass it on"):
        step(state, batches[0])


# What zeroshard's own steps return is typed as a plain jit's outputs.


@pytest.mark.parametrize("context", ["none", "auto", "explicit"])
def test_what_the_steps_return_is_typed_as_a_plain_jit_output(context):
    """Outside any mesh context (an Explicit mesh: the outputs feed nnx metrics whose
    reset() and single-device arithmetic run) and inside jax.set_mesh on an Auto and
    on an Explicit mesh: the metrics of make_train_step and of the Flax steps, and the
    NNX model's variables, work in ordinary arithmetic and in an nnx.jit eval step."""
    axis_type = AxisType.Auto if context == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    batch = {"x": jnp.ones((8, 2)), "y": jnp.ones((8, 1))}
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    nnx_loss = lambda m, b: (jnp.mean((m(b["x"]) - b["y"]) ** 2), m(b["x"]))
    tx = zs.sharded(optax.sgd(0.1))

    @nnx.jit
    def eval_step(model, metrics, batch):  # as the NNX MNIST tutorial writes it
        loss, out = nnx_loss(model, batch)
        metrics.update(loss=loss, values=out)

    with contextlib.nullcontext() if context == "none" else jax.set_mesh(mesh):
        state = zs.init_train_state({"w": jnp.zeros((2, 1))}, tx, mesh)
        state, from_step = zs.make_train_step(loss, tx, mesh)(state, batch)
        linen = zf.linen_train_state(lambda v, x: x, {"w": jnp.zeros((2, 1))}, tx, mesh)
        linen, from_linen = zf.linen_train_step(loss, tx, mesh)(linen, batch)
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        optimizer = zf.nnx_optimizer(model, tx, mesh)
        from_nnx = zf.nnx_train_step(nnx_loss, mesh, has_aux=True)(model, optimizer, batch)
        for metrics in (from_step, from_linen, from_nnx):
            assert float(metrics["loss"] * 2.0) == pytest.approx(2 * float(metrics["loss"]))
            assert float(jnp.sum(metrics["grad_norm"]) + jnp.zeros(())) >= 0
            average = nnx.metrics.Average()
            average.update(values=metrics["loss"])
            assert float(average.compute()) == pytest.approx(float(metrics["loss"]))
            average.reset()
            average.update(values=jnp.float32(2.0))
            assert float(average.compute()) == 2.0
        assert float(jnp.sum(from_nnx["aux"] * 2.0)) == pytest.approx(
            2 * float(jnp.sum(from_nnx["aux"]))
        )
        assert float(jnp.sum(state.params["w"] * 2.0) + jnp.sum(linen.params["w"] * 2.0)) != 0
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), out=nnx.metrics.Average())
        metrics.update(loss=from_nnx["loss"], values=from_nnx["aux"])
        eval_step(model, metrics, batch)  # the model's variables typed as the metrics are
        assert np.isfinite(float(metrics.compute()["loss"]))
        assert float(jnp.sum(model.kernel[...] * 2.0)) != 0
