"""Public Flax programs, trained with only the optimizer and the step swapped.

The models follow the Flax NNX MNIST tutorial (conv, BatchNorm, dropout, avg pool,
two linears; metrics from the returned logits) and the Flax Linen MNIST example,
with smaller images and widths so the suite stays fast. Every change to the program
a user would need is a bug; the only changes here are the optimizer and the step.
"""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, make_mesh
from jax.sharding import NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import zeroshard as zs
import zeroshard.flax as zf

SIDE = 12  # images SIDE x SIDE x 1 (the tutorial: 28)


def mnist_like(rng, steps=3, size=32):
    return [
        {
            "image": jnp.asarray(rng.normal(size=(size, SIDE, SIDE, 1)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 10, size=size), jnp.int32),
        }
        for _ in range(steps)
    ]


# The Flax NNX MNIST tutorial.


class CNN(nnx.Module):
    """The tutorial's CNN (channels 8/16 and 32 hidden instead of 32/64 and 256)."""

    def __init__(self, *, rngs: nnx.Rngs, rate: float = 0.025):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(16 * (SIDE // 4) ** 2, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=rate, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x)))
        return self.linear2(x)


def loss_fn(model, batch):  # as in the tutorial
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


def nnx_reference(model, tx, batches):
    """The tutorial's own loop: nnx.Optimizer and nnx.jit on one device."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (_, logits), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return logits

    return [train_step(model, optimizer, batch) for batch in batches]


def nnx_zeroshard(model, tx, batches, n=8):
    """The same loop with the optimizer and the step swapped for zeroshard's."""
    mesh = make_mesh(n)
    optimizer = zf.nnx_optimizer(model, zs.sharded(tx, axis_name="data"), mesh)
    train_step = zf.nnx_train_step(loss_fn, mesh, has_aux=True)
    return [train_step(model, optimizer, batch) for batch in batches]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_nnx_mnist_tutorial_matches_plain_optax(mode, rng):
    """Train mode without dropout (BatchNorm on the global batch, as on one device) and
    eval mode (dropout on but deterministic): parameters and statistics as plain optax."""
    batches = mnist_like(rng)
    rate = 0.0 if mode == "train" else 0.025
    model, reference = CNN(rngs=nnx.Rngs(0), rate=rate), CNN(rngs=nnx.Rngs(0), rate=rate)
    if mode == "eval":
        model.eval(), reference.eval()
    expected = nnx_reference(reference, optax.sgd(0.05, momentum=0.9), batches)
    metrics = nnx_zeroshard(model, optax.sgd(0.05, momentum=0.9), batches)
    params, ref_params = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (model, reference))
    if mode == "train":  # a bias right before BatchNorm has a zero gradient: rounding only
        for p in (params, ref_params):
            for conv in ("conv1", "conv2"):
                assert np.abs(np.asarray(p[conv].pop("bias"))).max() < 1e-7
    assert_trees_close(params, ref_params, 1e-5)
    assert_trees_close(nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), 1e-5)
    for m, logits in zip(metrics, expected, strict=True):
        assert m["aux"].shape == (32, 10)  # the global per-example logits
        np.testing.assert_allclose(m["aux"], logits, rtol=1e-4, atol=1e-5)
    if mode == "train":  # the statistics moved, identically on every device
        mean = model.batch_norm1.mean[...]
        assert np.abs(np.asarray(mean)).max() > 0
        assert all(
            np.array_equal(s.data, mean.addressable_shards[0].data) for s in mean.addressable_shards
        )


def test_nnx_mnist_tutorial_with_muon(rng):
    """An optimizer that needs whole matrices (its dense kernels owned) in the NNX step."""
    batches = mnist_like(rng)
    model, reference = CNN(rngs=nnx.Rngs(0), rate=0.0), CNN(rngs=nnx.Rngs(0), rate=0.0)
    nnx_reference(reference, optax.contrib.muon(0.02), batches)
    nnx_zeroshard(model, optax.contrib.muon(0.02), batches)
    params, ref_params = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (model, reference))
    for p in (params, ref_params):  # biases right before BatchNorm: zero gradients
        for conv in ("conv1", "conv2"):
            p[conv].pop("bias")
    assert_trees_close(params, ref_params, 1e-5)


def test_nnx_mnist_tutorial_with_dropout_and_metrics(rng):
    """The tutorial as written (dropout 0.025, BatchNorm, nnx.MultiMetric on the logits)."""
    batches = mnist_like(rng)
    model = CNN(rngs=nnx.Rngs(0))
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    for batch, m in zip(batches, nnx_zeroshard(model, optax.adamw(1e-3), batches), strict=True):
        metrics.update(loss=m["loss"], logits=m["aux"], labels=batch["label"])
    result = metrics.compute()
    assert 0.0 <= float(result["accuracy"]) <= 1.0 and np.isfinite(float(result["loss"]))
    mean = model.batch_norm2.mean[...]
    assert all(
        np.array_equal(s.data, mean.addressable_shards[0].data) for s in mean.addressable_shards
    )


class Dropped(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 1, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        mask = self.dropout(jnp.ones_like(x))
        return self.linear(x * mask), mask


def test_nnx_dropout_differs_per_device_and_is_reproducible(rng):
    batches = [{"x": jnp.ones((32, 16)), "y": jnp.zeros((32, 1))} for _ in range(3)]

    def loss(model, batch):
        out, mask = model(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2), mask

    def run(seed):
        mesh, model = make_mesh(8), Dropped(nnx.Rngs(seed))
        optimizer = zf.nnx_optimizer(model, zs.sharded(optax.sgd(0.1)), mesh)
        step = zf.nnx_train_step(loss, mesh, has_aux=True)
        masks = [np.asarray(step(model, optimizer, b)["aux"]) for b in batches]
        return model.linear.kernel[...], masks

    kernel, masks = run(0)
    per_device = masks[0].reshape(8, -1)
    assert len({m.tobytes() for m in per_device}) == 8  # each device its own mask
    assert not np.array_equal(masks[0], masks[1])  # and a new one each step
    again, _ = run(0)
    np.testing.assert_array_equal(kernel, again)  # the same seed: bit-identical
    assert not np.array_equal(kernel, run(1)[0])


# The Flax Linen MNIST example, and a Linen model with BatchNorm and dropout.


class LinenCNN(nn.Module):
    """The Linen MNIST example's CNN (channels 8/16, 32 hidden)."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(features=16, kernel_size=(3, 3))(x)), (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(features=10)(nn.relu(nn.Dense(features=32)(x)))


class LinenNormed(nn.Module):
    rate: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(features=8, kernel_size=(3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(self.rate, deterministic=not train)(nn.relu(x))
        return nn.Dense(features=10)(x.reshape((x.shape[0], -1)))


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize(
    "optimizer",
    [lambda: optax.sgd(0.05, momentum=0.9), lambda: optax.lamb(1e-2)],
    ids=["example_sgd", "lamb_owned"],
)
def test_linen_mnist_example_matches_plain_optax(optimizer, rng):
    batches, model = mnist_like(rng), LinenCNN()
    params = model.init(jax.random.key(0), jnp.ones((1, SIDE, SIDE, 1)))["params"]
    tx = optimizer()  # the example's optimizer, and one whose leaves are owned

    def apply_model(params, batch):  # the example's loss: (loss, logits)
        logits = model.apply({"params": params}, batch["image"])
        return xent(logits, batch["label"]), logits

    ref_params, opt_state, expected = params, tx.init(params), []
    for batch in batches:
        (_, logits), grads = jax.value_and_grad(apply_model, has_aux=True)(ref_params, batch)
        updates, opt_state = tx.update(grads, opt_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        expected.append(logits)

    mesh, stx = make_mesh(8), zs.sharded(tx, axis_name="data")
    state = zf.linen_train_state(model.apply, params, stx, mesh)
    step = zf.linen_train_step(apply_model, stx, mesh, has_aux=True)
    for batch, logits in zip(batches, expected, strict=True):
        state, metrics = step(state, batch)
        accuracy = jnp.mean(jnp.argmax(metrics["aux"], -1) == batch["label"])  # as the example
        np.testing.assert_allclose(metrics["aux"], logits, rtol=1e-4, atol=1e-5)
        assert 0 <= float(accuracy) <= 1
    assert_trees_close(state.params, ref_params, 1e-5)


def linen_normed_loss(model):
    def loss(params, batch, key=None, model_state=None):  # Flax's mutable= convention
        logits, updates = model.apply(
            {"params": params, **model_state},
            batch["image"],
            train=True,
            rngs=None if key is None else {"dropout": key},
            mutable=["batch_stats"],
        )
        return xent(logits, batch["label"]), updates

    return loss


def test_linen_batch_norm_matches_global_batch_and_restores(rng, tmp_path):
    batches, model = mnist_like(rng), LinenNormed()
    variables = model.init(jax.random.key(0), jnp.ones((1, SIDE, SIDE, 1)), train=False)
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    loss = linen_normed_loss(model)
    tx = optax.sgd(0.05, momentum=0.9)

    ref_params, ref_state, opt_state = params, model_state, tx.init(params)
    for batch in batches:
        (_, ref_state), grads = jax.value_and_grad(
            lambda p, s=ref_state, b=batch: loss(p, b, model_state=s), has_aux=True
        )(ref_params)
        updates, opt_state = tx.update(grads, opt_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)

    mesh, stx = make_mesh(8), zs.sharded(tx, axis_name="data")
    state = zf.linen_train_state(model.apply, params, stx, mesh, model_state=model_state)
    step = zf.linen_train_step(loss, stx, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    assert_trees_close(state.params, ref_params, 1e-5)
    assert_trees_close(state.model_state, ref_state, 1e-5)

    # The statistics are in the checkpoint, restored on another device count.
    functional = zs.TrainState(state.step, state.params, state.opt_state, state.model_state)
    with zs.CheckpointManager(str(tmp_path / "ckpt"), stx) as ckpt:
        ckpt.save(functional)
        ckpt.wait_until_finished()
        restored = ckpt.restore(make_mesh(2), like=params, model_state=model_state)
    for a, b in zip(
        jax.tree.leaves(restored.model_state), jax.tree.leaves(state.model_state), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_linen_dropout_key_is_reproducible(rng):
    batches, model = mnist_like(rng), LinenNormed(rate=0.5)
    variables = model.init(jax.random.key(0), jnp.ones((1, SIDE, SIDE, 1)), train=False)
    model_state = {"batch_stats": variables["batch_stats"]}
    loss, mesh = linen_normed_loss(model), make_mesh(8)
    stx = zs.sharded(optax.sgd(0.05), axis_name="data")
    step = zf.linen_train_step(loss, stx, mesh)

    def run(seed):
        state = zf.linen_train_state(
            model.apply, variables["params"], stx, mesh, model_state=model_state
        )
        for i, batch in enumerate(batches):
            state, _ = step(state, batch, jax.random.fold_in(jax.random.key(seed), i))
        return state.params

    a, b, c = run(0), run(0), run(1)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c), strict=True)
    )


# The miniGPT example (JAX AI stack): sharding-annotated kernels, out_sharding= calls,
# a ("batch", "model")-style mesh with jax.make_mesh's default axis types.


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, *, rngs: nnx.Rngs, rate: float = 0.1):
        kernel, bias = {"out_sharding": P(None, "model")}, {"out_sharding": P("model")}
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=embed_dim,
            kernel_metadata=kernel,
            bias_metadata=bias,
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        norm = {"scale_metadata": bias, "bias_metadata": bias}
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs, **norm)
        self.mlp = nnx.Sequential(
            nnx.Linear(embed_dim, ff_dim, kernel_metadata=kernel, bias_metadata=bias, rngs=rngs),
            nnx.relu,
            nnx.Linear(ff_dim, embed_dim, kernel_metadata=kernel, bias_metadata=bias, rngs=rngs),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs, **norm)

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        out1 = self.layer_norm1(inputs + self.dropout1(attention_output))
        return self.layer_norm2(out1 + self.mlp(out1))


class MiniGPT(nnx.Module):
    def __init__(self, maxlen=8, vocab_size=64, embed_dim=16, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(
            *[TransformerBlock(embed_dim, 2, 16, rngs=rngs) for _ in range(2)]
        )
        self.output_layer = nnx.Linear(
            embed_dim,
            vocab_size,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        positions = jnp.arange(0, inputs.shape[1])[None, :]
        x = self.token_emb(inputs, out_sharding=jax.typeof(inputs).sharding)
        x = self.transformer_blocks(x + self.pos_emb(positions))
        return reshard(self.output_layer(x), jax.typeof(inputs).sharding)


def gpt_loss(model, batch):  # as in the example
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


def token_batches(rng, steps=3, size=16):
    tokens = [rng.integers(0, 64, size=(size, 8)).astype(np.int32) for _ in range(steps)]
    return [(jnp.asarray(t), jnp.asarray(np.roll(t, -1, axis=1))) for t in tokens]


@pytest.mark.parametrize("shape", [(4, 2), (8, 1)])
def test_annotated_minigpt_on_its_mesh(shape, rng):
    batches, tx = token_batches(rng), optax.sgd(0.1, momentum=0.9)
    mesh = jax.make_mesh(shape, ("data", "model"))  # the default axis types
    with jax.set_mesh(mesh):
        model = MiniGPT(rngs=nnx.Rngs(0))
        model.eval()  # dropout off: the run must equal plain optax
        optimizer = zf.nnx_optimizer(model, zs.sharded(tx, axis_name="data"), mesh)
        step = zf.nnx_train_step(gpt_loss, mesh, has_aux=True)
        metrics = [step(model, optimizer, batch) for batch in batches]
        trained = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        model.train()
        assert np.isfinite(float(step(model, optimizer, batches[0])["loss"]))  # dropout on
    kernel = model.output_layer.kernel[...]
    assert kernel.sharding.spec == P(None, "model")  # the annotation is honoured
    assert metrics[0]["aux"].shape == (16, 8, 64)

    # Optimizer bytes per device: 1/8 of plain optax's on both meshes: the state is split
    # over the model axis too, not only over the 4 or 8 data devices.
    plain = sum(x.nbytes for x in jax.tree.leaves(tx.init(trained)))
    sharded = zs.state_bytes_per_device(nnx.as_pure(optimizer.opt_state.inner_state))
    leaves, n = len(jax.tree.leaves(trained)), mesh.size
    print(f"\nminiGPT on {shape}: momentum per device {sharded:,} B vs plain {plain:,} B / {n}")
    assert plain / n <= sharded <= plain / n + leaves * n * 4

    # Parity in eval mode: plain optax on one device, with the example's own step.
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    with jax.set_mesh(one):
        reference = MiniGPT(rngs=nnx.Rngs(0))
        reference.eval()
        ref_opt = nnx.Optimizer(reference, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, batch):
            (_, logits), grads = nnx.value_and_grad(gpt_loss, has_aux=True)(model, batch)
            optimizer.update(model, grads)
            return logits

        on_one = NamedSharding(one, P("data"))  # the example places its batches so
        logits = [train_step(reference, ref_opt, jax.device_put(b, on_one)) for b in batches]
    for m, expected in zip(metrics, logits, strict=True):
        np.testing.assert_allclose(m["aux"], expected, rtol=1e-4, atol=1e-5)
    expected = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    for block in range(2):  # attention's key bias has a zero gradient: rounding only
        for tree in (trained, expected):
            bias = tree["transformer_blocks"]["layers"][block]["mha"]["key"].pop("bias")
            assert np.abs(np.asarray(bias)).max() < 1e-8
    assert_trees_close(trained, expected, 1e-5)
