"""Programs that compute the state's shardings from annotations, with the one line.

The Linen program is written the t5x way (flax's lm1b, MaxText): a transformer LM whose
weights carry ``nn.with_logical_partitioning`` names, a ``TrainState``, the state's
shardings from ``nn.get_partition_spec(jax.eval_shape(init))`` mapped by
``nn.logical_to_mesh_sharding(..., mesh, RULES)``, init and step jitted with them, the
program's own orbax checkpoint; the NNX one lays ``nnx.Optimizer``'s state out by
``nnx.get_partition_spec(nnx.state(optimizer))``. Each runs with plain optax, then with
only the optimizer line changed to ``zs.sharded(...)``; the reference is plain optax in
the same program on the same mesh.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from flax.training import train_state
from helpers import per_device_bytes
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs

AXES = ("data", "fsdp", "tensor")
MESHES = {"fsdp": (4, 2, 1), "tensor": (4, 1, 2)}  # 4 data x 2 fsdp, 4 data x 2 tensor
RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", "tensor"),
    ("activation_mlp", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
)
VOCAB, WIDTH, STEPS = 64, 32, 6


def mesh_of(kind):
    return Mesh(np.array(jax.devices()).reshape(MESHES[kind]), AXES)  # Auto axes


def token_batches(mesh, steps=STEPS):
    rng, rows = np.random.default_rng(0), NamedSharding(mesh, P(("data", "fsdp")))
    tokens = [rng.integers(0, VOCAB, size=(8, 9)) for _ in range(steps)]
    return [jax.device_put({"inputs": t[:, :-1], "targets": t[:, 1:]}, rows) for t in tokens]


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def assert_spread(opt_state, plain_opt_state):
    """Every device holds at most 1.10x of plain optax's state / 8, and no leaf of at
    least 8 elements is replicated anywhere (each device holds 1/8 of it)."""
    total = sum(x.nbytes for x in jax.tree.leaves(plain_opt_state))
    held = per_device_bytes(opt_state)
    assert len(held) == 8 and max(held.values()) <= 1.10 * total / 8, (held, total)
    for x in jax.tree.leaves(opt_state):
        assert x.size < 8 or x.addressable_shards[0].data.size * 8 == x.size, x.sharding


# The Linen program.

part = nn.with_logical_partitioning
xavier = nn.initializers.xavier_uniform()


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        norm = lambda: nn.LayerNorm(
            use_bias=False, scale_init=part(nn.initializers.ones, ("embed",))
        )
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        attention = nn.MultiHeadDotProductAttention(
            num_heads=4,
            use_bias=False,
            kernel_init=part(xavier, ("embed", "kv")),
            deterministic=True,
        )
        x = x + attention(norm()(x), mask=mask)
        h = nn.Dense(2 * WIDTH, kernel_init=part(xavier, ("embed", "mlp")))(norm()(x))
        h = nn.with_logical_constraint(
            nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp")
        )
        x = x + nn.Dense(WIDTH, kernel_init=part(xavier, ("mlp", "embed")))(h)
        return nn.with_logical_constraint(
            x, ("activation_batch", "activation_length", "activation_embed")
        )


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(
            VOCAB, WIDTH, embedding_init=part(nn.initializers.normal(1.0), ("vocab", "embed"))
        )(tokens)
        for _ in range(2):
            x = Block()(x)
        x = nn.LayerNorm(use_bias=False, scale_init=part(nn.initializers.ones, ("embed",)))(x)
        return nn.Dense(VOCAB, use_bias=False, kernel_init=part(xavier, ("embed", "vocab")))(x)


def unbox_logicallypartioned(tree):
    """flax lm1b's ``unbox_logicallypartioned_trainstate``."""
    is_box = lambda x: isinstance(x, nn.spmd.LogicallyPartitioned)
    return jax.tree.map(lambda x: x.unbox() if is_box(x) else x, tree, is_leaf=is_box)


class LinenProgram:
    """The program's setup: its state's shardings, init and jitted step on ``mesh``."""

    def __init__(self, optimizer, mesh):
        model = LinenLM()

        def init(key):
            variables = model.init(key, jnp.ones((8, 8), jnp.int32))
            return train_state.TrainState.create(
                apply_fn=model.apply, params=variables["params"], tx=optimizer
            )

        def train_step(state, batch):
            def loss_fn(params):
                logits = state.apply_fn({"params": params}, batch["inputs"])
                return cross_entropy(logits, batch["targets"])

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss

        self.key, self.mesh = jax.random.key(0), mesh
        self.abstract = jax.eval_shape(init, self.key)
        logical = nn.get_partition_spec(self.abstract)
        self.shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
        self.init = jax.jit(init, out_shardings=self.shardings)
        data = NamedSharding(mesh, P(("data", "fsdp")))
        self.step = jax.jit(
            train_step, in_shardings=(self.shardings, data), out_shardings=(self.shardings, None)
        )

    def start(self):
        with nn_partitioning.axis_rules(RULES):
            return unbox_logicallypartioned(self.init(self.key))

    def train(self, state, batches):
        losses = []
        for batch in batches:
            with nn_partitioning.axis_rules(RULES):
                state, loss = self.step(state, batch)
            losses.append(float(loss))
        return state, losses

    def target(self):
        """The abstract state with its shardings: what the program restores into."""
        abstract = unbox_logicallypartioned(self.abstract)
        as_struct = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return jax.tree.map(as_struct, abstract, self.shardings)


def linen_run(make_optimizer, mesh, tmp_path):
    """The program's 6 steps, saving after 3 with its own orbax manager; then a fresh
    run restored from that step, trained on the last 3 batches."""
    program, data = LinenProgram(make_optimizer(mesh), mesh), token_batches(mesh)
    state, first = program.train(program.start(), data[:3])
    with ocp.CheckpointManager(tmp_path / "linen") as manager:
        manager.save(3, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
    state, rest = program.train(state, data[3:])
    program = LinenProgram(make_optimizer(mesh), mesh)  # (a restarted job)
    with ocp.CheckpointManager(tmp_path / "linen") as manager:
        restored = manager.restore(3, args=ocp.args.StandardRestore(program.target()))
    resumed, again = program.train(restored, data[3:])
    return program, state, first + rest, (resumed, again)


ONE_LINE = {  # optimizer = ... for a program on ``mesh``, with and without mesh=
    "mesh=": lambda mesh: zs.sharded(optax.adamw(1e-2), mesh=mesh),
    "no mesh=": lambda mesh: zs.sharded(optax.adamw(1e-2)),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain optax's run of a program (``linen_run``, ``nnx_run``), once per mesh."""
    runs = {}

    def run(program, kind):
        if (program, kind) not in runs:
            path = tmp_path_factory.mktemp(f"plain_{program.__name__}_{kind}")
            runs[program, kind] = program(lambda m: optax.adamw(1e-2), mesh_of(kind), path)
        return runs[program, kind]

    return run


@pytest.mark.parametrize("line", ONE_LINE)
@pytest.mark.parametrize("kind", MESHES)
def test_a_linen_program_with_logical_axis_rules(kind, line, plain, tmp_path):
    """Only the optimizer line changed: 1/8 of plain optax's state on every device,
    plain optax's losses, the parameters laid out by their annotations, and the
    program's checkpoint restored continues bit for bit. Without mesh=, the program
    sets its mesh with jax.set_mesh (the tx.init that jax.eval_shape traces has no
    other way to know it; test_without_any_mesh_init_says_how_to_give_it)."""
    mesh = mesh_of(kind)
    _, plain_state, plain_losses, _ = plain(linen_run, kind)
    if line == "mesh=":
        program, state, losses, (resumed, again) = linen_run(ONE_LINE[line], mesh, tmp_path)
    else:
        with jax.set_mesh(mesh):
            program, state, losses, (resumed, again) = linen_run(ONE_LINE[line], mesh, tmp_path)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert losses[-1] < losses[0] - 0.1  # (real updates)
    assert_spread(state.opt_state, plain_state.opt_state)
    for got, want, annotated in zip(
        *(jax.tree.leaves(t) for t in (state.params, plain_state.params, program.shardings.params)),
        strict=True,
    ):
        assert got.sharding.is_equivalent_to(annotated, got.ndim)
        assert want.sharding.is_equivalent_to(annotated, got.ndim)
    assert again == losses[3:]
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_without_any_mesh_init_says_how_to_give_it():
    """No mesh=, no mesh set: jax.eval_shape traces tx.init on parameters that carry no
    layout; the error names the fix."""
    with pytest.raises(ValueError) as refused:
        LinenProgram(zs.sharded(optax.adamw(1e-2)), mesh_of("fsdp"))
    assert any("zs.sharded(inner, mesh=mesh)" in note for note in refused.value.__notes__)


# The NNX program.

npart = nnx.with_partitioning
nxavier = nnx.initializers.xavier_uniform()


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        ones = npart(nnx.initializers.ones, ("embed",))
        self.norm = nnx.LayerNorm(WIDTH, use_bias=False, scale_init=ones, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            4,
            WIDTH,
            use_bias=False,
            kernel_init=npart(nxavier, ("embed", "heads", "kv")),
            decode=False,
            rngs=rngs,
        )
        self.up = nnx.Linear(
            WIDTH, 2 * WIDTH, kernel_init=npart(nxavier, ("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(
            2 * WIDTH, WIDTH, kernel_init=npart(nxavier, ("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attention(self.norm(x), mask=mask, deterministic=True)
        return x + self.down(nnx.gelu(self.up(x)))


class NNXLM(nnx.Module):
    def __init__(self, rngs):
        init = npart(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])
        self.out = nnx.Linear(
            WIDTH, VOCAB, use_bias=False, kernel_init=npart(nxavier, ("embed", "vocab")), rngs=rngs
        )

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def nnx_create(optimizer):
    """The model and its optimizer, the state laid out as its metadata says."""

    @nnx.jit
    def create():
        model = NNXLM(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
        state = nnx.state(opt)
        nnx.update(opt, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model, opt

    return create()


@nnx.jit
def nnx_step(model, optimizer, batch):
    loss_fn = lambda model: cross_entropy(model(batch["inputs"]), batch["targets"])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def nnx_run(make_optimizer, mesh, tmp_path):
    """The NNX program: created, the layout of its optimizer state then, 6 steps saving
    the state after 3 with orbax, and the last 3 again from the restored state."""
    data = token_batches(mesh)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        model, optimizer = nnx_create(make_optimizer(mesh))
        created = nnx.as_pure(nnx.state(optimizer))  # (the arrays now)
        losses = [float(nnx_step(model, optimizer, batch)) for batch in data[:3]]
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "nnx", nnx.state((model, optimizer)))
        checkpointer.wait_until_finished()
        losses += [float(nnx_step(model, optimizer, batch)) for batch in data[3:]]
        pair = nnx.eval_shape(lambda: nnx_create(make_optimizer(mesh)))
        abstract = nnx.state(pair)
        shardings = nnx.get_named_sharding(abstract, mesh)
        as_struct = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        target = jax.tree.map(as_struct, abstract, shardings)
        restored = nnx.merge(*nnx.split(pair)[:1], checkpointer.restore(tmp_path / "nnx", target))
        again = [float(nnx_step(*restored, batch)) for batch in data[3:]]
    return (model, optimizer), created, losses, (restored, again)


@pytest.mark.parametrize("line", ONE_LINE)
@pytest.mark.parametrize("kind", MESHES)
def test_an_nnx_program_lays_the_optimizer_out_by_its_metadata(kind, line, plain, tmp_path):
    """nnx.Optimizer's state constrained to nnx.get_partition_spec of itself: 1/8 of
    plain optax's on every device from the start (not replicated), plain optax's
    losses, the parameters as annotated, and an orbax checkpoint of nnx.state that
    continues bit for bit. (NNX makes annotated variables under a mesh set with
    jax.set_mesh: without mesh=, the optimizer takes that one.)"""
    mesh = mesh_of(kind)
    _, plain_created, plain_losses, _ = plain(nnx_run, kind)
    (model, optimizer), created, losses, (restored, again) = nnx_run(ONE_LINE[line], mesh, tmp_path)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert losses[-1] < losses[0] - 0.1
    assert_spread(created, plain_created)
    assert_spread(nnx.as_pure(nnx.state(optimizer)), plain_created)
    params = nnx.state(model, nnx.Param)
    with nnx.logical_axis_rules(RULES):  # (each as its metadata says; unannotated: P())
        annotated = nnx.get_named_sharding(params, mesh)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(annotated), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    assert again == losses[3:]
    for a, b in zip(
        jax.tree.leaves(nnx.state(restored)),
        jax.tree.leaves(nnx.state((model, optimizer))),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class TrainStateWithGraph(train_state.TrainState):
    graphdef: nnx.GraphDef


def lm1b_nnx_run(optimizer, mesh):
    """flax's lm1b_nnx: a Linen TrainState of the NNX model's nnx.Param state (the
    optimizer's too, Variables with their metadata), laid out by
    nnx.get_partition_spec, the step jitted with nnx.get_named_sharding."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):  # (lm1b_nnx: `with mesh:`)
        graphdef, params = nnx.split(NNXLM(nnx.Rngs(0)), nnx.Param)
        state = TrainStateWithGraph.create(
            apply_fn=graphdef.apply, params=params, tx=optimizer, graphdef=graphdef
        )
        state = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
        shardings = nnx.get_named_sharding(state, mesh)
    created = per_device_bytes(state.opt_state)

    def train_step(state, batch):
        def loss_fn(params):
            logits = nnx.merge(state.graphdef, params)(batch["inputs"])
            return cross_entropy(logits, batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    step = jax.jit(train_step, in_shardings=(shardings, None), out_shardings=(shardings, None))
    losses = []
    with nnx.logical_axis_rules(RULES):
        for batch in token_batches(mesh):
            state, loss = step(state, batch)
            losses.append(float(loss))
    return state, created, losses


def test_flax_lm1b_nnx_train_state():
    """The optimizer's state as Variables in a TrainState: tx.update takes and returns
    them so. 1/8 of plain optax's state per device from the start, its losses."""
    mesh = mesh_of("fsdp")
    plain, plain_created, plain_losses = lm1b_nnx_run(optax.adamw(1e-2), mesh)
    state, created, losses = lm1b_nnx_run(zs.sharded(optax.adamw(1e-2), mesh=mesh), mesh)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    total = sum(x.nbytes for x in jax.tree.leaves(plain.opt_state))
    assert max(created.values()) <= 1.10 * total / 8 < max(plain_created.values())
    assert_spread(state.opt_state, plain.opt_state)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain.params), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def test_a_layout_of_the_program_s_own_is_refused_naming_the_leaf():
    """On Explicit axes a traced state's type shows its layout: a program that gave
    zeroshard's state shardings of its own (here: replicated) is refused at trace
    time, naming the leaf and the fix."""
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put({"w": jnp.ones((16, 32)), "b": jnp.ones(32)}, replicated)
    tx = zs.sharded(optax.adam(1e-2), mesh=mesh)
    state = tx.init(params)
    forced = jax.tree.map(lambda _: replicated, state)

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rows = NamedSharding(mesh, P("data"))
    step = jax.jit(
        step, in_shardings=(replicated, forced, rows), out_shardings=(replicated, forced)
    )
    with pytest.raises(
        ValueError, match=r"leaf opt_state\.inner_state\[0\]\.mu\['.'\] is laid out as P\("
    ):
        step(params, jax.device_put(state, forced), jax.device_put(jnp.ones((8, 16)), rows))
