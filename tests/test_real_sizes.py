"""Whole-tensor optimizers at real sizes: plain optax's numbers, and 1/N of its state.

Most other tests of owned leaves use widths of 32 or less, below every threshold at
which these optimizers change what they compute, so they miss the code paths a real
model reaches:

- Adafactor factors the second moment of a leaf only when its two largest
  dimensions are both >= 128 (``min_dim_size_to_factor``): then its state is a row
  and a column vector, not an array shaped like the leaf, and a stand-in must be
  typed like those vectors. A smaller matrix (and every bias) keeps the unfactored
  moment; ``factored=False`` keeps it for every leaf.
- Muon orthogonalises every 2-D matrix whole. On a scan-over-layers model the layers
  are stacked into 3-D leaves, and ``MuonDimensionNumbers(reduction_axis=1,
  output_axis=2)`` makes each layer its own matrix (the layer axis is a batch axis).
- LAMB, LARS and novograd scale each leaf by per-tensor norms; with an embedding
  holding ~45% of the parameters, the device owning it holds most of the state.

Every run is checked against plain optax on one device on the global batch (the
gradient taken as the mean over the devices' parts of the batch): relative L2 error
per leaf below 2e-5. The memory tests encode the bounds an optimizer-state sharding
should meet: the device holding most optimizer state (inner state, master weights and
owned storage) holds at most 1.25x (Muon and Adafactor on 8 stacked layers) or 1.15x
(LAMB and LARS with the large embedding) of plain optax's state bytes over N.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_mesh
from optax.contrib import MuonDimensionNumbers
from test_owned import reference, relative_errors, resumed_elsewhere

import zeroshard as zs

N = 8
LAYERS = 8
# The bar: relative L2 error per leaf after a few steps (the runs here differ
# from plain optax by ~1e-7, from the order of summation).
RTOL = 2e-5
# Each leaf must move by far more than RTOL in the reference (relative to its scale),
# so an error of a small fraction of the update is seen.
MIN_MOVEMENT = 50 * RTOL
STACKED_BOUND = 1.25  # largest per-device state over plain/N: Muon, Adafactor, stacked
EMBED_BOUND = 1.15  # the same for LAMB and LARS with a ~45% embedding
BLOCKED_BOUND = 1.25  # the same, and the update's max/mean, for a dominant matrix

# Each stacked 3-D leaf is LAYERS matrices: axis 0 is a batch axis for Muon.
STACKED_DIMS = {
    "blocks": {
        "up": MuonDimensionNumbers(reduction_axis=1, output_axis=2),
        "b": None,
        "down": MuonDimensionNumbers(reduction_axis=1, output_axis=2),
    }
}
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "adafactor_unfactored": lambda: optax.adafactor(1e-2, factored=False),
    "muon": lambda: optax.contrib.muon(1e-2),
    # Weight decay on one matrix only: its update reads its weights, the others' do not.
    "muon_decay_up": lambda: optax.contrib.muon(
        1e-2, weight_decay=0.1, weight_decay_mask=lambda p: {k: k == "up" for k in p}
    ),
    "muon_stacked": lambda: optax.contrib.muon(1e-2, muon_weight_dimension_numbers=STACKED_DIMS),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1.0),
    "novograd": lambda: optax.novograd(1e-2),
    # Other updates that need whole tensors: a per-row clip, per-axis maxima, noise drawn
    # at the leaf's shape, a mask computed from shapes.
    "adaptive_grad_clip": lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1)),
    "sm3": lambda: optax.sm3(0.1),
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=0),
    "shape_mask": lambda: optax.adamw(
        1e-2, eps=1e-3, mask=lambda p: jax.tree.map(lambda x: x.shape[0] == 256, p)
    ),
}


def _normal(rng: np.random.Generator, *shape: int) -> jax.Array:
    """Normal entries scaled by 1/sqrt(fan-in) (the second-to-last dimension)."""
    fan_in = shape[-2] if len(shape) > 1 else shape[-1]
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in), jnp.float32)


def _whole(params: dict) -> dict:
    """``params`` with stage-3 pieces gathered (full arrays pass through), so each loss
    runs in every stage and in the reference."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, zs.Piece))
    return zs.gather(params) if any(isinstance(x, zs.Piece) for x in leaves) else params


# An MLP: two matrices Adafactor factors, biases and a small matrix it does not.


def dense_params(rng: np.random.Generator) -> dict:
    """(128, 256) and (256, 128) matrices, their biases, and a (128, 32) head."""
    return {
        "up": _normal(rng, 128, 256),
        "b_up": jnp.asarray(rng.normal(size=256) / 10, jnp.float32),
        "down": _normal(rng, 256, 128),
        "b_down": jnp.asarray(rng.normal(size=128) / 10, jnp.float32),
        "head": _normal(rng, 128, 32),
    }


def dense_loss(params: dict, batch: dict) -> jax.Array:
    """Squared error of ``tanh(tanh(x @ up + b_up) @ down + b_down) @ head``."""
    p = _whole(params)
    h = jnp.tanh(batch["x"] @ p["up"] + p["b_up"])
    h = jnp.tanh(h @ p["down"] + p["b_down"])
    return jnp.mean((h @ p["head"] - batch["y"]) ** 2)


def dense_batches(rng: np.random.Generator, steps: int, size: int = 48) -> list[dict]:
    """``steps`` batches of ``size`` inputs (128 features) and targets (32)."""
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(size, 128), "y": f(size, 32)} for _ in range(steps)]


# Scan over LAYERS stacked residual blocks.


def stacked_params(rng: np.random.Generator) -> dict:
    """Blocks stacked on a leading layer axis: (8, 128, 256), (8, 256), (8, 256, 128)."""
    return {
        "blocks": {
            "up": _normal(rng, LAYERS, 128, 256),
            "b": jnp.asarray(rng.normal(size=(LAYERS, 256)) / 10, jnp.float32),
            "down": _normal(rng, LAYERS, 256, 128) / 2,
        }
    }


def stacked_loss(params: dict, batch: dict) -> jax.Array:
    """``x + tanh(x @ up + b) @ down`` per layer, with ``jax.lax.scan`` over the layers."""
    blocks = _whole(params)["blocks"]
    block = lambda x, p: (x + jnp.tanh(x @ p["up"] + p["b"]) @ p["down"], None)
    x, _ = jax.lax.scan(block, batch["x"], blocks)
    return jnp.mean((x - batch["y"]) ** 2)


def stacked_batches(rng: np.random.Generator, steps: int, size: int = 48) -> list[dict]:
    """``steps`` batches of ``size`` inputs and targets of 128 features."""
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(size, 128), "y": f(size, 128)} for _ in range(steps)]


# A classifier whose (2048, 128) embedding is ~44% of its parameters.


def embed_params(rng: np.random.Generator) -> dict:
    """The embedding, two residual MLP blocks (128 -> 512 -> 128) and a (128, 512) head."""
    block = lambda: {
        "w1": _normal(rng, 128, 512),
        "b1": jnp.zeros(512),
        "w2": _normal(rng, 512, 128),
        "b2": jnp.zeros(128),
    }
    params = {"embed": _normal(rng, 2048, 128), "mlp": [block(), block()]}
    params["out"] = _normal(rng, 128, 512)
    return params


def embed_loss(params: dict, batch: dict) -> jax.Array:
    """Cross-entropy of the 512-way classification of each embedded token."""
    p = _whole(params)
    x = p["embed"][batch["tokens"]] * np.sqrt(128)
    for b in p["mlp"]:
        x = x + jnp.tanh(x @ b["w1"] + b["b1"]) @ b["w2"] + b["b2"]
    logits = x @ p["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def embed_batches(rng: np.random.Generator, steps: int, size: int = 48) -> list[dict]:
    """``steps`` batches of ``size`` tokens (of 2048) and labels (of 512)."""
    return [
        {
            "tokens": jnp.asarray(rng.integers(0, 2048, size)),
            "labels": jnp.asarray(rng.integers(0, 512, size)),
        }
        for _ in range(steps)
    ]


# An unscanned MLP of two matrices Adafactor factors (T5-style models are unscanned).


def mlp_params(rng: np.random.Generator) -> dict:
    """A (256, 512) and a (512, 256) matrix and a bias."""
    return {"up": _normal(rng, 256, 512), "b": jnp.zeros(512), "down": _normal(rng, 512, 256)}


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    """Squared error of ``tanh(x @ up + b) @ down``."""
    p = _whole(params)
    return jnp.mean((jnp.tanh(batch["x"] @ p["up"] + p["b"]) @ p["down"] - batch["y"]) ** 2)


def mlp_batches(rng: np.random.Generator, steps: int, size: int = 48) -> list[dict]:
    """``steps`` batches of ``size`` inputs and targets of 256 features."""
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return [{"x": f(size, 256), "y": f(size, 256)} for _ in range(steps)]


MODELS = {
    "mlp": (mlp_params, mlp_loss, mlp_batches, None),
    "dense": (dense_params, dense_loss, dense_batches, None),
    "stacked": (stacked_params, stacked_loss, stacked_batches, ["blocks"]),
    "embed": (embed_params, embed_loss, embed_batches, None),
}


@pytest.fixture(scope="module")
def setups() -> dict:
    """Per model: ``(params, batches, loss_fn, stacked)``: 3 steps of 48 examples (a
    multiple of 8, of 2 x 8 for accumulation, and of 3 and 2 for the restores)."""
    out = {}
    for seed, (name, (make, loss_fn, make_batches, stacked)) in enumerate(MODELS.items()):
        rng = np.random.default_rng(seed)
        out[name] = (make(rng), make_batches(rng, 3), loss_fn, stacked)
    return out


@pytest.fixture(scope="module")
def expected(setups):
    """``expected(optimizer, model)``: plain optax's weights, computed once per pair."""
    cache = {}

    def get(optimizer: str, model: str) -> dict:
        """Plain optax's weights for ``optimizer`` on ``model`` after its batches."""
        if (optimizer, model) not in cache:
            params, data, loss_fn, _ = setups[model]
            inner = optax.with_extra_args_support(OPTIMIZERS[optimizer]())
            cache[optimizer, model] = reference(inner, params, data, loss_fn, N)
        return cache[optimizer, model]

    return get


def train(optimizer, setup, *, n=N, stage=1, accum_steps=1, skip_nonfinite=True):
    """Trains a model with ``zs.make_train_step`` on all of its batches.

    Args:
      optimizer: a key of OPTIMIZERS, wrapped in ``zs.sharded``.
      setup: ``(params, batches, loss_fn, stacked)`` from the ``setups`` fixture.
      n: the number of devices.
      stage: the ZeRO stage (1, 2 or 3).
      accum_steps: micro-batches per step.
      skip_nonfinite: ``zs.sharded``'s option of that name.

    Returns:
      The final weights (the fp32 master, whole).
    """
    params, data, loss_fn, stacked = setup
    tx = zs.sharded(OPTIMIZERS[optimizer](), skip_nonfinite=skip_nonfinite, stacked=stacked)
    mesh = make_mesh(n)
    state = zs.init_train_state(params, tx, mesh, stage=stage)
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage, accum_steps=accum_steps)
    for batch in data:
        state, _ = step(state, batch)
    return zs.to_optax_state(state, tx)[0] if stage == 3 else state.params


def assert_matches_plain_optax(actual, expected, initial, context) -> None:
    """Every leaf's relative L2 error (see ``relative_errors``) is below RTOL, where
    plain optax moved every leaf by at least MIN_MOVEMENT."""
    moved = relative_errors(expected, initial, initial)
    assert min(moved.values()) > MIN_MOVEMENT, (context, moved)
    errors = relative_errors(actual, expected, initial)
    worst = max(errors, key=errors.get)
    print(f"{context}: worst leaf {worst} relative error {errors[worst]:.1e}")
    assert errors[worst] < RTOL, (context, errors)


def factored_leaves(inner, params: dict) -> set[str]:
    """The keys of ``params`` (a flat dict) whose second moment plain optax's Adafactor
    ``inner`` factors: those whose ``v_row`` is more than the (1,) placeholder."""
    is_factored = lambda x: isinstance(x, optax.FactoredState)
    state = jax.eval_shape(inner.init, params)
    moments = next(x for x in jax.tree.leaves(state, is_leaf=is_factored) if is_factored(x))
    return {k for k, v in moments.v_row.items() if v.shape != (1,)}


@pytest.mark.parametrize("skip_nonfinite", [True, False])
@pytest.mark.parametrize("optimizer", ["adafactor", "adafactor_unfactored"])
def test_adafactor_on_large_and_small_matrices(optimizer, skip_nonfinite, setups, expected):
    """Default Adafactor factors exactly the two matrices with both dims >= 128 (so the
    test reaches the factored path); ``factored=False`` factors none."""
    params = setups["dense"][0]
    factored = factored_leaves(OPTIMIZERS[optimizer](), params)
    assert factored == ({"up", "down"} if optimizer == "adafactor" else set())
    got = train(optimizer, setups["dense"], skip_nonfinite=skip_nonfinite)
    assert_matches_plain_optax(got, expected(optimizer, "dense"), params, optimizer)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
@pytest.mark.parametrize(("optimizer", "model"), [("muon", "dense"), ("muon_stacked", "stacked")])
def test_muon_on_large_and_stacked_matrices(optimizer, model, skip_nonfinite, setups, expected):
    """Muon on 2-D matrices >= 128, and on 8 scan-stacked layers, each its own matrix."""
    got = train(optimizer, setups[model], skip_nonfinite=skip_nonfinite)
    assert_matches_plain_optax(got, expected(optimizer, model), setups[model][0], optimizer)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_adafactor_on_stacked_layers(skip_nonfinite, setups, expected):
    """Adafactor factors each stacked (8, 128, 256) leaf over its last two axes."""
    params = setups["stacked"][0]
    assert factored_leaves(OPTIMIZERS["adafactor"](), params["blocks"]) == {"up", "down"}
    got = train("adafactor", setups["stacked"], skip_nonfinite=skip_nonfinite)
    assert_matches_plain_optax(got, expected("adafactor", "stacked"), params, "adafactor")


@pytest.mark.parametrize("optimizer", ["lamb", "lars", "novograd"])
def test_per_tensor_norms_with_a_large_embedding(optimizer, setups, expected):
    """LAMB, LARS and novograd: the embedding's norms are those of the whole leaf."""
    params = setups["embed"][0]
    share = params["embed"].size / sum(x.size for x in jax.tree.leaves(params))
    assert 0.4 < share < 0.5, share
    got = train(optimizer, setups["embed"])
    assert_matches_plain_optax(got, expected(optimizer, "embed"), params, optimizer)


@pytest.mark.parametrize(
    ("optimizer", "model"),
    [("muon_stacked", "stacked"), ("adafactor", "stacked"), ("lamb", "embed")],
)
def test_stages_and_accumulation(optimizer, model, setups, expected):
    """Stages 1-3 with two micro-batches per step (stage 3 on 4 devices)."""
    for stage, n in ((1, 8), (2, 8), (3, 4)):
        got = train(optimizer, setups[model], n=n, stage=stage, accum_steps=2)
        context = f"{optimizer} stage {stage} on {n}"
        assert_matches_plain_optax(got, expected(optimizer, model), setups[model][0], context)


@pytest.mark.parametrize("optimizer", ["muon_stacked", "adafactor"])
def test_stacked_layers_restore_on_other_device_counts(optimizer, setups, expected, tmp_path):
    """A checkpoint of the stacked model saved on 8 devices (one layer each), one step
    in, resumed on 3 (stage 1: 3, 3 and 2 layers) and 2 (stage 3): the same weights as
    plain optax after 3 steps."""
    params, data, loss_fn, stacked = setups["stacked"]
    tx = zs.sharded(OPTIMIZERS[optimizer](), stacked=stacked)
    for (stage, n), got in resumed_elsewhere(loss_fn, tx, params, data, tmp_path):
        context = f"{optimizer} restored at stage {stage} on {n}"
        assert_matches_plain_optax(got, expected(optimizer, "stacked"), params, context)


def per_layer_then_whole_rms():
    """Each layer divided by its own norm (a sum over that layer only), then the leaf by
    its RMS over all layers (a sum across layers): on one layer per device, the first
    sum must stay local and the second be summed over the devices."""

    def update(u, state, params=None):
        def one(x):
            per_layer = jnp.sqrt(jnp.sum(x * x, axis=tuple(range(1, x.ndim)), keepdims=True))
            y = x / per_layer
            return y / jnp.sqrt(jnp.mean(y * y) + 1.0)

        return jax.tree.map(one, u), state

    return optax.chain(
        optax.GradientTransformation(lambda p: optax.EmptyState(), update), optax.sgd(0.05)
    )


def test_sums_per_layer_and_across_layers(setups):
    params, data, loss_fn, stacked = setups["stacked"]
    inner = per_layer_then_whole_rms()
    tx = zs.sharded(inner, stacked=stacked)
    assert {s.placement for s in tx.plan(params, N).layout.slots} == {"layer-owned"}
    mesh = make_mesh(N)
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(loss_fn, tx, mesh)
    for batch in data:
        state, _ = step(state, batch)
    expected = reference(optax.with_extra_args_support(inner), params, data, loss_fn, N)
    assert_matches_plain_optax(state.params, expected, params, "per-layer and whole sums")


def test_layers_meeting_through_sums_need_a_layer_on_every_device(setups):
    """Adafactor's update clipping is an RMS over the whole stacked leaf: owned layer by
    layer, each device sums its layers and the sums are summed over the devices, so
    every device must hold a layer; with fewer layers than devices the leaf is owned
    whole. Muon's layers never meet: 4 layers go to 4 devices."""
    params = setups["stacked"][0]
    few = jax.tree.map(lambda x: x[:4], params)
    placements = {}
    for optimizer in ("adafactor", "muon_stacked"):
        for name, tree in (("8 layers", params), ("4 layers", few)):
            tx = zs.sharded(OPTIMIZERS[optimizer](), stacked=["blocks"])
            up = next(s for s in tx.plan(tree, N).layout.slots if "up" in s.path)
            placements[optimizer, name] = (up.placement, len(set(up.owners)))
    assert placements == {
        ("adafactor", "8 layers"): ("layer-owned", 8),
        ("adafactor", "4 layers"): ("owned", 1),
        ("muon_stacked", "8 layers"): ("layer-owned", 8),
        ("muon_stacked", "4 layers"): ("layer-owned", 4),
    }


# Memory: bytes of the optimizer state each device holds, after init (training does
# not change the shapes).

MEMORY_CASES = {  # id: (optimizer, model, bound)
    "muon_stacked": ("muon_stacked", "stacked", STACKED_BOUND),
    "adafactor_stacked": ("adafactor", "stacked", STACKED_BOUND),
    "lamb_embed": ("lamb", "embed", EMBED_BOUND),
    "lars_embed": ("lars", "embed", EMBED_BOUND),
    # One whole-tensor unit larger than a device's share: updated on blocks everywhere.
    "adafactor_mlp": ("adafactor", "mlp", BLOCKED_BOUND),
    "muon_embed": ("muon", "embed", BLOCKED_BOUND),
}


def largest_device_bytes(tree) -> int:
    """The bytes of ``tree``'s shards on the device holding most.

    Args:
      tree: a pytree of global ``jax.Array``s.

    Returns:
      The maximum over devices of the bytes of all the shards that device holds.
    """
    per_device: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    return max(per_device.values())


def sharded_state(optimizer: str, setup) -> tuple:
    """``(tx, state)``: the sharded optimizer and a stage-1 state of ``setup``'s model
    on N devices."""
    params, _, _, stacked = setup
    tx = zs.sharded(OPTIMIZERS[optimizer](), stacked=stacked)
    return tx, zs.init_train_state(params, tx, make_mesh(N))


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_estimate_memory_is_what_a_device_holds(case, setups):
    """``zs.estimate_memory`` (stage 1, fp32 parameters) of ``zs.sharded(inner,
    stacked=...)`` reports the measured bytes, layer-owned stacks included."""
    optimizer, model, _ = MEMORY_CASES[case]
    params = setups[model][0]
    tx, state = sharded_state(optimizer, setups[model])
    opt = state.opt_state
    measured = zs.state_bytes_per_device((opt.inner_state, opt.master, opt.owned))
    est = zs.estimate_memory(params, N, stage=1, param_dtype=jnp.float32, optimizer=tx)
    print(f"{case}: measured {measured:,} B, estimated {est.optimizer_state + est.master:,.0f} B")
    assert measured == est.optimizer_state + est.master


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_largest_device_state_is_near_plain_over_n(case, setups):
    """The most loaded device's inner state, master and owned storage, over plain
    optax's state bytes / N, is within the issue's bound."""
    optimizer, model, bound = MEMORY_CASES[case]
    params = setups[model][0]
    tx, state = sharded_state(optimizer, setups[model])
    inner, opt = tx.inner, state.opt_state
    largest = largest_device_bytes((opt.inner_state, opt.master, opt.owned))
    plain = zs.state_bytes_per_device(jax.eval_shape(inner.init, params))
    ratio = largest / (plain / N)
    print(f"{case}: largest device {largest:,} B, plain/N {plain / N:,.0f} B, ratio {ratio:.3f}")
    assert ratio <= bound, f"{case}: {ratio:.3f} > {bound}"


# Stage 3: the weights of owned leaves are pieces like the sliced ones'; the owners
# gather what they update (issue 22).

WEIGHT_BOUND = 1.15  # stage-3 weight bytes per device over the parameters' bytes / N


def stacked_layer_loss(params: dict, batch: dict) -> jax.Array:
    """``stacked_loss`` as a stage-3 program writes it: each scan iteration gathers its
    layer only (``zs.layer``; whole arrays pass through in stages 1 and 2)."""
    block = zs.layer(lambda p, x: x + jnp.tanh(x @ p["up"] + p["b"]) @ p["down"])
    x, _ = jax.lax.scan(lambda x, p: (block(p, x), None), batch["x"], params["blocks"])
    return jnp.mean((x - batch["y"]) ** 2)


def dense_layer_loss(params: dict, batch: dict) -> jax.Array:
    """``dense_loss`` gathering one layer at a time (``zs.layer``)."""
    dense = zs.layer(lambda p, x: jnp.tanh(x @ p[0] + p[1]))
    h = dense((params["up"], params["b_up"]), batch["x"])
    h = dense((params["down"], params["b_down"]), h)
    return jnp.mean((zs.layer(lambda w, h: h @ w)(params["head"], h) - batch["y"]) ** 2)


@pytest.mark.parametrize(
    ("optimizer", "model"),
    [
        ("muon_stacked", "stacked"),
        ("adafactor", "stacked"),
        ("muon", "dense"),
        ("adafactor", "dense"),
    ],
)
def test_stage3_weights_are_pieces_whatever_the_optimizer(optimizer, model, setups, expected):
    """Stage-3 weights per device within 1.15x of params / N though every matrix is
    owned (whole or layer by layer), the same numbers as plain optax, and no more
    temporaries than stage 1's (the losses gathering one layer at a time)."""
    params, data, loss_fn, stacked = setups[model]
    loss_fn = {"stacked": stacked_layer_loss, "dense": dense_layer_loss}[model]
    tx = zs.sharded(OPTIMIZERS[optimizer](), stacked=stacked)
    assert any(s.owned or s.blocked for s in tx.plan(params, N).layout.slots)
    mesh = make_mesh(N)
    temps, args = {}, {}
    for stage in (1, 3):
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
        memory = step.lower(state, data[0]).compile().memory_analysis()
        temps[stage], args[stage] = memory.temp_size_in_bytes, memory.argument_size_in_bytes
    held = zs.state_bytes_per_device(state.params)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(
        f"{optimizer} {model}: stage-3 weights {held:,} B/device, params/N {total / N:,.0f} B; "
        f"temporaries stage 1 {temps[1]:,} B, stage 3 {temps[3]:,} B"
    )
    assert held <= WEIGHT_BOUND * total / N
    # Scanning over layers, stage 3 holds one gathered layer at a time. Unscanned, each
    # layer it gathers is a temporary where stage 1 has it as an argument (AdamW too):
    # there the two together are compared.
    if model == "stacked":
        assert temps[3] <= temps[1]
    assert temps[3] + args[3] <= temps[1] + args[1]
    for batch in data:
        state, _ = step(state, batch)
    got = zs.to_optax_state(state, tx)[0]
    assert_matches_plain_optax(got, expected(optimizer, model), params, f"{optimizer} stage 3")


ESTIMATE_CASES = [("adamw", "stacked"), ("muon_stacked", "stacked"), ("adafactor", "stacked")]
ESTIMATE_CASES += [("lamb", "embed"), ("muon", "dense")]


@pytest.mark.parametrize(("optimizer", "model"), ESTIMATE_CASES)
def test_estimate_memory_is_what_each_stage_holds(optimizer, model, setups):
    """``zs.estimate_memory`` of ``zs.sharded(inner, ...)``, stages 1-3 (bf16 params,
    fp32 master): its params, optimizer state and master within 2% of the bytes a
    device holds (the state's arrays), and of the compiled step's arguments less the
    batch."""
    params, data, loss_fn, stacked = setups[model]
    tx = zs.sharded(OPTIMIZERS[optimizer](), stacked=stacked)
    mesh = make_mesh(N)
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(data[0])) / N
    for stage in (1, 2, 3):
        state = zs.init_train_state(params, tx, mesh, stage=stage, param_dtype=jnp.bfloat16)
        held = zs.state_bytes_per_device((state.params, state.opt_state))
        est = zs.estimate_memory(params, N, stage=stage, optimizer=tx)
        planned = est.params + est.optimizer_state + est.master
        step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
        arguments = step.lower(state, data[0]).compile().memory_analysis().argument_size_in_bytes
        print(
            f"{optimizer} stage {stage}: planned {planned:,.0f} B, held {held:,} B, "
            f"arguments less batch {arguments - batch_bytes:,.0f} B"
        )
        assert planned == pytest.approx(held, rel=0.02)
        assert planned == pytest.approx(arguments - batch_bytes, rel=0.02)


@pytest.mark.parametrize("optimizer", ["muon", "muon_decay_up"])
def test_stage3_owners_get_the_weights_their_update_reads(optimizer, setups, expected):
    """fp32 stage 3 keeps no master: the owners gather an owned leaf's weights only
    where the update reads them (weight decay), and send back the new weights; the
    others' owners send back the update, which each device adds to its piece."""
    params, data, _, stacked = setups["dense"]
    tx = zs.sharded(OPTIMIZERS[optimizer](), stacked=stacked)
    reads = {tx.plan(params, N).layout.slots[i].path for i in tx.plan(params, N).analysis.reads}
    assert ("['up']" in reads) == (optimizer == "muon_decay_up") and "['down']" not in reads
    mesh = make_mesh(N)
    state = zs.init_train_state(params, tx, mesh, stage=3)
    step = zs.make_train_step(dense_layer_loss, tx, mesh, stage=3)
    for batch in data:
        state, _ = step(state, batch)
    got = zs.to_optax_state(state, tx)[0]
    assert_matches_plain_optax(got, expected(optimizer, "dense"), params, f"{optimizer} stage 3")


# A whole-tensor unit larger than a device's share (both of the MLP's factored
# matrices; the embedding under Muon's default, which orthogonalises every 2-D leaf) is
# updated on blocks of rows or columns on every device (zeroshard.core.blocks).

BLOCKED = {"adafactor": ("mlp", {"['up']", "['down']"}), "muon": ("embed", {"['embed']"})}


@pytest.mark.parametrize("optimizer", sorted(BLOCKED))
def test_a_dominant_whole_tensor_update_is_spread(optimizer, setups, expected):
    """Blocked, the update's work per device is at most 1.25x the mean and the numbers
    are plain optax's, in stages 1 and 3."""
    model, dominant = BLOCKED[optimizer]
    params = setups[model][0]
    tx = zs.sharded(OPTIMIZERS[optimizer]())
    blocked = {s.path for s in tx.plan(params, N).layout.slots if s.blocked}
    assert dominant <= blocked, blocked
    est = zs.estimate_memory(params, N, param_dtype=jnp.float32, optimizer=tx)
    print(f"{optimizer} {model}: blocked {sorted(blocked)}, update {est.update_imbalance:.2f}")
    assert est.update_imbalance <= BLOCKED_BOUND
    for stage in (1, 3):
        got = train(optimizer, setups[model], stage=stage)
        context = f"{optimizer} {model} stage {stage}"
        assert_matches_plain_optax(got, expected(optimizer, model), params, context)


@pytest.mark.parametrize("optimizer", sorted(BLOCKED))
def test_blocked_state_restores_on_other_device_counts(optimizer, setups, expected, tmp_path):
    """Saved on 8 devices (blocked), resumed on 3 (rows that do not divide by 3: owned
    whole) and on 2 in stage 3 (blocked again): plain optax's weights."""
    model = BLOCKED[optimizer][0]
    params, data, loss_fn, _ = setups[model]
    tx = zs.sharded(OPTIMIZERS[optimizer]())
    for (stage, n), got in resumed_elsewhere(loss_fn, tx, params, data, tmp_path):
        context = f"{optimizer} {model} restored at stage {stage} on {n}"
        assert_matches_plain_optax(got, expected(optimizer, model), params, context)


@pytest.mark.parametrize("optimizer", ["adaptive_grad_clip", "noisy_sgd", "shape_mask", "sm3"])
def test_other_whole_tensor_updates_run_on_blocks(optimizer, setups, expected):
    """What else reads a matrix whole (per-row norms, per-axis maxima, noise drawn at
    its full shape on every device and cut, a mask from its shape) is blocked too, with
    plain optax's numbers."""
    params = setups["mlp"][0]
    layout = zs.sharded(OPTIMIZERS[optimizer]()).plan(params, N).layout
    assert "['up']" in {s.path for s in layout.slots if s.blocked}
    got = train(optimizer, setups["mlp"])
    assert_matches_plain_optax(got, expected(optimizer, "mlp"), params, optimizer)
