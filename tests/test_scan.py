"""Scan over stacked layers (jax.lax.scan, nnx.scan, nn.scan) in stages 1-3: parity with
plain optax, 1/N of every layer per device, one layer gathered per iteration."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, make_mesh, reference_run

import zeroshard as zs
import zeroshard.flax as zf
from zeroshard.core.layout import Layout

LAYERS, WIDTH = 4, 16


def make_params(rng, layers=LAYERS, width=WIDTH):
    f = lambda *s: jnp.asarray(rng.normal(size=s) / s[-1] ** 0.5, jnp.float32)
    return {
        "blocks": {"w": f(layers, width, width), "b": f(layers, width) / 10},
        "head": f(width, width),
    }


def block(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def plain_loss(params, batch):
    x, _ = jax.lax.scan(lambda x, p: (block(p, x), None), batch["x"], params["blocks"])
    return jnp.mean((x @ params["head"] - batch["y"]) ** 2)


def stage3_loss(params, batch):
    layer = zs.layer(block)
    x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), batch["x"], params["blocks"])
    return jnp.mean((x @ zs.gather(params["head"]) - batch["y"]) ** 2)


def prefetch_loss(params, batch):
    x = zs.layers(block)(params["blocks"], batch["x"])
    return jnp.mean((x @ zs.gather(params["head"]) - batch["y"]) ** 2)


def data(rng, steps=3, size=32, width=WIDTH):
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(size, width), "y": f(size, width)} for _ in range(steps)]


def train(loss_fn, inner, params, batches, stage, accum_steps=1, n=8, stacked=("blocks",)):
    mesh = make_mesh(n)
    tx = zs.sharded(inner, axis_name="data", stacked=stacked)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage, accum_steps=accum_steps)
    for batch in batches:
        state, _ = step(state, batch)
    return zs.to_optax_state(state, tx)[0], state, tx


CASES = [  # (optimizer, stage, accum_steps): SGD everywhere, AdamW on a few
    *[("sgd", s, a) for s in (1, 2, 3) for a in (1, 2)],
    ("adamw", 1, 1),
    ("adamw", 2, 2),
    ("adamw", 3, 2),
]
OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.1, momentum=0.9), 1e-6),
    "adam": (lambda: optax.adam(1e-2), 1e-5),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), 1e-5),
}


@pytest.mark.parametrize("name,stage,accum_steps", CASES)
def test_lax_scan_matches_plain_optax(name, stage, accum_steps, rng):
    make, rtol = OPTIMIZERS[name]
    params, batches = make_params(rng), data(rng)
    expected = reference_run(plain_loss, make(), params, batches)
    loss_fn = stage3_loss if stage == 3 else plain_loss
    actual, state, _ = train(loss_fn, make(), params, batches, stage, accum_steps)
    assert_trees_close(actual, expected, rtol=rtol)
    if stage == 3:  # each device holds piece d of every layer: (layers, 1, width)
        piece = state.params["blocks"]["w"].piece
        assert piece.addressable_shards[0].data.shape == (LAYERS, 1, WIDTH * WIDTH // 8)


def largest_reduce_scatter(loss_fn, params, batch, stage=2):
    """Bytes per device of the largest reduce-scatter result in a step's lowered program."""
    mesh = make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", stacked=("blocks",))
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    text = zs.make_train_step(loss_fn, tx, mesh, stage=stage).lower(state, batch).as_text()
    return max(c.result_bytes for c in zs.lowered_collectives(text) if c.kind == "reduce-scatter")


@pytest.mark.parametrize("name,accum_steps", [("sgd", 1), ("sgd", 2), ("adam", 1), ("adam", 2)])
def test_stage2_through_gathers_matches_plain_optax(name, accum_steps, rng):
    """Stage 2 with a loss that gathers (zs.layer in the scan, zs.gather on the head)
    reduce-scatters each layer's gradient in the backward pass, and trains as plain
    optax does on one device on the global batch."""
    make, rtol = OPTIMIZERS[name]
    params, batches = make_params(rng), data(rng)
    expected = reference_run(plain_loss, make(), params, batches)
    actual, _, _ = train(stage3_loss, make(), params, batches, 2, accum_steps)
    assert_trees_close(actual, expected, rtol=rtol)
    # One layer's gradient reduce-scattered at a time (its 1/N piece), not the stack's.
    layer_piece = (WIDTH * WIDTH + WIDTH) * 4 // 8
    assert largest_reduce_scatter(stage3_loss, params, batches[0]) == layer_piece
    assert largest_reduce_scatter(plain_loss, params, batches[0]) >= LAYERS * layer_piece


@pytest.mark.parametrize("name,stage,accum_steps", [("sgd", 3, 1), ("sgd", 2, 2), ("adamw", 3, 2)])
def test_prefetch_in_the_own_step_matches_plain_optax(name, stage, accum_steps, rng):
    """zs.layers (each layer's weights gathered while the one before runs) trains as
    plain optax does; at stage 2 it reduce-scatters one layer's gradient at a time."""
    make, rtol = OPTIMIZERS[name]
    params, batches = make_params(rng), data(rng)
    expected = reference_run(plain_loss, make(), params, batches)
    actual, _, _ = train(prefetch_loss, make(), params, batches, stage, accum_steps)
    assert_trees_close(actual, expected, rtol=rtol)
    if stage == 2:
        layer_piece = (WIDTH * WIDTH + WIDTH) * 4 // 8
        assert largest_reduce_scatter(prefetch_loss, params, batches[0]) == layer_piece


def test_prefetch_in_the_own_step_leaves_gathers_and_dots_independent(rng):
    """In the own step's compiled loop bodies, zs.layers' gathers and dots depend on
    each other in neither direction (a backend with asynchronous collectives can
    overlap them); zs.layer's dots wait for their layer's gather."""
    from test_dropin_stage3 import loop_ties

    params, batch, mesh = make_params(rng), data(rng, steps=1)[0], make_mesh(8)
    tx = zs.sharded(optax.sgd(0.1), axis_name="data", stacked=("blocks",))
    state = zs.init_train_state(params, tx, mesh, stage=3)
    for loss_fn, overlaps in ((prefetch_loss, True), (stage3_loss, False)):
        hlo = zs.make_train_step(loss_fn, tx, mesh, stage=3).lower(state, batch).compile()
        assert loop_ties(hlo.as_text()) == [not overlaps] * 2, loss_fn


def test_stage2_reads_through_gathers_or_not_at_all(rng):
    """A stage-2 loss that reads a parameter other than through zs.gather (cast first,
    or not gathered at all) runs the plain stage-2 step: the full gradient, then one
    reduce-scatter of the stack, and the same training as plain optax."""

    def cast_first(params, batch):
        return stage3_loss(jax.tree.map(lambda x: x * 1.0, params), batch)

    def head_direct(params, batch):
        layer = zs.layer(block)
        x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), batch["x"], params["blocks"])
        return jnp.mean((x @ params["head"] - batch["y"]) ** 2)

    params, batches = make_params(rng), data(rng, steps=2)
    expected = reference_run(plain_loss, optax.sgd(0.1, momentum=0.9), params, batches)
    stack_piece = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 // 8
    for loss_fn in (cast_first, head_direct):
        assert largest_reduce_scatter(loss_fn, params, batches[0]) >= stack_piece
        actual, _, _ = train(loss_fn, optax.sgd(0.1, momentum=0.9), params, batches, 2)
        assert_trees_close(actual, expected, rtol=1e-6)


def test_scanning_unstacked_pieces_raises(rng):
    """The silently wrong case: a stacked leaf laid out as one raveled leaf is refused."""
    params, batches = make_params(rng), data(rng, steps=1)
    with pytest.raises(ValueError, match="stacked"):
        train(stage3_loss, optax.sgd(0.1), params, batches, stage=3, stacked=None)


def test_stacked_option_checks_leaves():
    with pytest.raises(ValueError, match="no axis besides"):
        Layout.from_tree({"blocks": {"gate": jnp.zeros(4)}}, 2, stacked=["blocks"])


def test_scan_stage3_memory_and_per_layer_gathers(rng):
    """8 layers of 256x256: stage 3 with a scan holds (params + state) / N per device,
    uses no more temporaries than stage 1, and gathers one layer per iteration."""
    layers, width, n = 8, 256, 8
    params = make_params(rng, layers, width)
    batch = data(rng, steps=1, size=64, width=width)[0]
    mesh = make_mesh(n)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data", stacked=("blocks",))
    found = {}
    for stage, loss_fn in ((1, plain_loss), (3, stage3_loss)):
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
        lowered = step.lower(state, batch)
        mem = lowered.compile().memory_analysis()
        found[stage] = (mem, lowered.as_text(), zs.state_bytes_per_device(state))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    mem1, _, state1 = found[1]
    mem3, text3, state3 = found[3]
    # Stage 3: params, mu and nu, each 1/N (plus < N padding elements per layer).
    assert state3 <= 3 * param_bytes / n * 1.01 + 64
    assert state1 >= param_bytes + 2 * param_bytes / n
    assert mem3.temp_size_in_bytes <= mem1.temp_size_in_bytes
    print(
        f"\nscan, 8 layers of 256x256, N=8, AdamW: state/device stage 1 {state1:,} B, "
        f"stage 3 {state3:,} B; temporaries stage 1 {mem1.temp_size_in_bytes:,} B, "
        f"stage 3 {mem3.temp_size_in_bytes:,} B"
    )
    layer_bytes = (width * width + width) * 4  # w and b of one layer, gathered together
    gathers = [c.result_bytes for c in zs.lowered_collectives(text3) if c.kind == "all-gather"]
    assert gathers.count(layer_bytes) == 2  # in the forward and the backward loop bodies
    assert max(gathers) < 2 * layer_bytes  # never the whole stack


def test_scan_stage3_temporaries_grow_by_pieces_not_layers(rng):
    """Stage 3 over a scan keeps one layer's gathered weights and full gradient at a
    time: from 4 to 8 stacked layers its compiled temporaries grow by less than half a
    layer per layer (each layer's 1/N gradient piece, not the layer), while stage 1's
    grow by at least a full layer per layer (its full gradient)."""
    width, mesh = 256, make_mesh(8)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data", stacked=("blocks",))
    batch = data(rng, steps=1, size=64, width=width)[0]
    layer_bytes, temp = (width * width + width) * 4, {}
    for layers in (4, 8):
        params = make_params(rng, layers, width)
        for stage, loss_fn in ((1, plain_loss), (3, stage3_loss)):
            state = zs.init_train_state(params, tx, mesh, stage=stage)
            step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
            temp[stage, layers] = step.lower(state, batch).compile().memory_analysis()
    grown = {s: (temp[s, 8].temp_size_in_bytes - temp[s, 4].temp_size_in_bytes) / 4 for s in (1, 3)}
    assert grown[3] < 0.5 * layer_bytes, grown
    assert grown[1] >= layer_bytes, grown


def test_scan_stage2_gradient_temporaries_grow_by_pieces_not_layers(rng):
    """Stage 2 through a loss that gathers (bf16 weights, fp32 masters): from 4 to 8
    stacked layers its compiled temporaries grow by at most stage 3's growth (each
    layer's gradient piece) plus one bf16 layer per layer (the new weights,
    all-gathered whole: stage 2 keeps them so), while through a plain loss they grow
    by a bf16 layer more than that (its full gradient of every layer)."""
    width, mesh = 256, make_mesh(8)
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data", stacked=("blocks",))
    batch = data(rng, steps=1, size=64, width=width)[0]
    bf16_layer, temp = (width * width + width) * 2, {}
    cases = {"plain": (2, plain_loss), "gathers": (2, stage3_loss), "stage 3": (3, stage3_loss)}
    for layers in (4, 8):
        params = make_params(rng, layers, width)
        for name, (stage, loss_fn) in cases.items():
            state = zs.init_train_state(params, tx, mesh, stage=stage, param_dtype=jnp.bfloat16)
            step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
            temp[name, layers] = step.lower(state, batch).compile().memory_analysis()
    grown = {c: (temp[c, 8].temp_size_in_bytes - temp[c, 4].temp_size_in_bytes) / 4 for c in cases}
    assert grown["gathers"] <= grown["stage 3"] + bf16_layer, grown
    assert grown["plain"] >= grown["gathers"] + bf16_layer, grown


# The same model through Flax: NNX (nnx.vmap + nnx.scan) and Linen (nn.scan).


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.dense(x))


class NNXStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, x):
            return block(x)

        return body(self.blocks, x)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(WIDTH)(x)), None


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            LinenBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        return scan(name="blocks")(x, None)[0]


def flax_programs():
    """(params, plain loss, stage-3 loss) of each Flax scan model."""
    template = NNXBlock(nnx.Rngs(1))  # only its structure is used by nnx_layer
    model = NNXStack(nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    mse = lambda out, batch: jnp.mean((out - batch["y"]) ** 2)

    def nnx_plain(params, batch):
        return mse(nnx.merge(graphdef, nnx.State(params))(batch["x"]), batch)

    def nnx_stage3(params, batch):
        layer = zf.nnx_layer(template)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, p):
            return layer(p, x)

        return mse(body(batch["x"], params["blocks"]), batch)

    linen = LinenStack()
    variables = linen.init(jax.random.key(0), jnp.zeros((1, WIDTH)))

    def linen_plain(params, batch):
        return mse(linen.apply({"params": params}, batch["x"]), batch)

    def linen_stage3(params, batch):
        layer = zf.linen_layer(LinenBlock())
        x, _ = jax.lax.scan(lambda x, p: layer(p, x, None), batch["x"], params["blocks"])
        return mse(x, batch)

    return {
        "nnx": (nnx.to_pure_dict(state), nnx_plain, nnx_stage3),
        "linen": (variables["params"], linen_plain, linen_stage3),
    }


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("program", ["nnx", "linen"])
def test_flax_scan_models_match_plain_optax(program, stage, rng):
    params, plain, staged = flax_programs()[program]
    batches = data(rng, steps=2)
    expected = reference_run(plain, optax.sgd(0.1, momentum=0.9), params, batches)
    loss_fn = staged if stage == 3 else plain
    actual, _, tx = train(loss_fn, optax.sgd(0.1, momentum=0.9), params, batches, stage)
    layout = tx.plan(params, 8).layout
    assert {s.path for s in layout.slots if s.placement == "stacked"} == {
        s.path for s in layout.slots if "blocks" in s.path
    }
    assert_trees_close(actual, expected, rtol=1e-6)
