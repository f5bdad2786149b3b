"""The sharded state as an item of the user's own orbax ``CheckpointManager``.

Three kinds of state, each trained 2 steps on 8 devices and saved with
``zs.ShardedSave`` next to a JSON config item: a ``zs.TrainState``, a Linen
``TrainState`` subclass with an extra field (an EMA), and an NNX ``(model,
optimizer)`` pair whose model has batch statistics and a dropout RNG. Each restores on
8 devices and on 3 into a fresh target: the logical values (``zs.to_optax_state``:
what plain optax would hold, shaped as ``inner.init(params)``) and the extra leaves
equal the saved ones exactly, and one more step on 8 devices gives the parameters of
the uninterrupted run bit for bit. A damaged byte is refused, and so is a target of
another model, optimizer or fields.
"""

import os
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
from zeroshard.checkpointing import ShardedRestore, ShardedSave

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}
CONFIG = {"model": "mlp", "lr": 0.01}


def auto_mesh(n):
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def make_batches(n=3):
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return [{"x": f(24, 7), "y": f(24, 3)} for _ in range(n)]


def start_params():
    rng = np.random.default_rng(1)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
    return {"w1": f(7, 13), "b1": f(13), "w2": f(13, 3)}


def mse(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


# The three kinds: build on a mesh, take a step, and read (step, params, opt_state, extra).


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(13)(x)))


class TrainStateWithEMA(train_state.TrainState):
    ema: dict


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(7, 13, rngs=rngs)
        self.bn = nnx.BatchNorm(13, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(13, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def build(kind, name, mesh):
    if kind == "zeroshard":
        tx = zs.sharded(OPTIMIZERS[name](), axis_name="data")
        return zs.init_train_state(start_params(), tx, mesh), tx
    tx = zs.sharded(OPTIMIZERS[name](), mesh=mesh)
    if kind == "linen":
        params = MLP().init(jax.random.key(0), jnp.ones((1, 7)))["params"]
        params = jax.device_put(params, NamedSharding(mesh, P()))
        return TrainStateWithEMA.create(apply_fn=MLP().apply, params=params, tx=tx, ema=params), tx
    model = Net(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    return (model, nnx.Optimizer(model, tx, wrt=nnx.Param)), tx


@jax.jit
def linen_step(state, batch):
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)
    state = state.apply_gradients(grads=jax.grad(loss)(state.params))
    return state.replace(ema=jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema, state.params))


@nnx.jit
def nnx_step(model, optimizer, batch):
    loss = lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
    optimizer.update(model, nnx.grad(loss)(model))


def train(kind, state, tx, mesh, batches):
    batches = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
    if kind == "zeroshard":
        step = zs.make_train_step(mse, tx, mesh)
        for batch in batches:
            state, _ = step(state, batch)
        return state
    if kind == "linen":
        for batch in batches:
            state = linen_step(state, batch)
        return state
    for batch in batches:
        nnx_step(*state, batch)
    return state


def core(kind, state):
    """(step, params, opt_state, extra leaves) as numbers to compare."""
    if kind == "nnx":
        model, optimizer = state
        rest = nnx.state(model, nnx.Not(nnx.Param))
        rest = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, rest)
        step = optimizer.step[...]
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        return step, params, nnx.as_pure(optimizer.opt_state), nnx.as_pure(rest)
    extra = state.ema if kind == "linen" else None
    return state.step, state.params, state.opt_state, extra


def _is_key(x):
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def logical(kind, state, tx, mesh):
    """What plain optax would hold (numpy leaves, and the tree), plus the extra leaves."""
    step, params, opt_state, extra = core(kind, state)
    step = jax.device_put(jnp.asarray(step, jnp.int32), NamedSharding(mesh, P()))
    master, inner = zs.to_optax_state(zs.TrainState(step, params, opt_state), tx)
    assert jax.tree.structure(inner) == jax.tree.structure(tx.inner.init(master))
    leaves = jax.tree.leaves((int(step), master, inner, extra))
    return [np.asarray(x) for x in leaves], jax.tree.structure((master, inner, extra))


def assert_same(a, b):
    assert a[1] == b[1]
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0], strict=True):
        np.testing.assert_array_equal(x, y)


# The user's own manager.


def save(directory, step, state, tx=None):
    with ocp.CheckpointManager(directory) as mngr:  # orbax's defaults: async
        args = ocp.args.Composite(
            train_state=ShardedSave(state, tx), config=ocp.args.JsonSave(CONFIG)
        )
        assert mngr.save(step, args=args)
        mngr.wait_until_finished()


def restore(directory, step, target, tx=None, mesh=None):
    with ocp.CheckpointManager(directory) as mngr:
        args = ocp.args.Composite(
            train_state=ShardedRestore(target, tx, mesh), config=ocp.args.JsonRestore()
        )
        restored = mngr.restore(step, args=args)
    assert restored.config == CONFIG
    return restored.train_state


@pytest.fixture(scope="module", params=["zeroshard", "linen", "nnx"])
def kind(request):
    return request.param


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_restores_exactly_on_8_and_3_and_continues_identically(kind, name, tmp_path):
    batches, mesh = make_batches(), auto_mesh(8)
    state, tx = build(kind, name, mesh)
    state = train(kind, state, tx, mesh, batches[:2])
    saved = logical(kind, state, tx, mesh)
    save(tmp_path, 2, state, tx if kind == "zeroshard" else None)
    expected = core(kind, train(kind, state, tx, mesh, batches[2:]))

    target, tx8 = build(kind, name, mesh)  # a fresh state, as a restarted job builds it
    restored = restore(tmp_path, 2, target, tx8)
    assert_same(logical(kind, restored, tx8, mesh), saved)
    got = core(kind, train(kind, restored, tx8, mesh, batches[2:]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit-identical

    mesh3 = auto_mesh(3)
    target3, tx3 = build(kind, name, mesh3)
    restored3 = restore(tmp_path, 2, target3, tx3, mesh3)
    assert_same(logical(kind, restored3, tx3, mesh3), saved)
    opt_state = core(kind, restored3)[2]
    assert {d.id for x in jax.tree.leaves(opt_state) for d in x.devices()} == {0, 1, 2}


def test_plain_optax_reads_the_item_and_the_record_is_its_metadata(tmp_path):
    mesh = auto_mesh(8)
    state, _ = build("linen", "adamw", mesh)
    save(tmp_path, 0, state)
    record = zs.ShardedCheckpointHandler().metadata(tmp_path / "0" / "train_state")
    with ocp.CheckpointManager(tmp_path) as mngr:
        plain = mngr.restore(0, args=ocp.args.Composite(train_state=ocp.args.StandardRestore()))
    inner = optax.adamw(1e-2, weight_decay=0.1).init(state.params)
    assert len(jax.tree.leaves(plain.train_state["opt_state"])) == len(jax.tree.leaves(inner))
    assert record["num_shards"] == 8 and set(record["extra"]) == {
        "['ema']['Dense_0']['bias']",
        "['ema']['Dense_0']['kernel']",
        "['ema']['Dense_1']['bias']",
        "['ema']['Dense_1']['kernel']",
    }
    assert set(record["checksums"]) == {"algorithm", "step", "params", "opt_state", "extra"}


def tree_digest(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_damaged_byte_is_refused_naming_the_leaf(tmp_path):
    """Each data file of the item damaged in turn: refused (by a leaf's checksum where
    orbax reads the damaged bytes as values), or, where restore never reads the
    damaged bytes (orbax's per-process copies of the index), restored exactly."""
    mesh, tx = auto_mesh(8), zs.sharded(optax.adamw(1e-2), axis_name="data")
    params = dict(start_params(), big=jnp.asarray(np.random.default_rng(2).normal(size=(256, 256))))
    state = zs.init_train_state(params, tx, mesh)  # big: values in a data file of their own
    state = train("zeroshard", state, tx, mesh, make_batches(1))
    saved = logical("zeroshard", state, tx, mesh)
    save(tmp_path / "run", 1, state, tx)
    target = zs.init_train_state(params, tx, mesh)
    files = [p for p in (tmp_path / "run" / "1" / "train_state").rglob("*") if p.parent.name == "d"]
    messages = []
    for i, path in enumerate(sorted(files)):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(tmp_path / "run", copy)
        damaged = copy / os.path.relpath(path, tmp_path / "run")
        data = bytearray(damaged.read_bytes())
        for k in range(4):
            data[len(data) // 2 + k] ^= 0xFF
        damaged.write_bytes(bytes(data))
        before = tree_digest(copy)
        try:
            restored = restore(copy, 1, target, tx)
        except zs.CheckpointCorruptedError as e:
            messages.append(str(e))
            assert "corrupted" in str(e) and "Nothing on disk was changed" in str(e)
        else:
            assert_same(logical("zeroshard", restored, tx, mesh), saved)
        assert tree_digest(copy) == before
    by_checksum = [m for m in messages if "read from disk" in m]
    assert by_checksum and all(re.search(r"checksum of \S+\[", m) for m in by_checksum)


def test_a_mismatched_target_is_refused_naming_the_leaf(tmp_path):
    mesh = auto_mesh(8)
    state, _ = build("linen", "adamw", mesh)
    save(tmp_path, 0, state)
    before = tree_digest(tmp_path)
    other_optimizer, _ = build("linen", "sgd", mesh)
    with pytest.raises(ValueError, match=r"optimizer state leaf \[0\]"):
        restore(tmp_path, 0, other_optimizer)
    plain = train_state.TrainState.create(apply_fn=None, params=state.params, tx=state.tx)
    with pytest.raises(ValueError, match=r"extra leaf \['ema'\]\['Dense_0'\]\['bias'\]"):
        restore(tmp_path, 0, plain)
    params = MLP().init(jax.random.key(0), jnp.ones((1, 5)))["params"]  # other inputs
    other_model = TrainStateWithEMA.create(apply_fn=None, params=params, tx=state.tx, ema=params)
    with pytest.raises(ValueError, match=r"parameter \['Dense_1'\]\['kernel'\] is float32\[7"):
        restore(tmp_path, 0, other_model)
    plain_optax = state.replace(tx=optax.adamw(1e-2), opt_state=optax.adamw(1e-2).init(params))
    with pytest.raises(TypeError, match=r"zs.sharded"):
        restore(tmp_path, 0, plain_optax)
    assert tree_digest(tmp_path) == before
