"""zeroshard against what a JAX user would use instead, on the same model in one run.

Variants, per device count N and model size:

- (a) ``replicated``: data parallelism with ``shard_map`` + ``pmean``, plain optax;
- (b) ``jit-sharded``: plain optax under ``jax.jit`` with the optimizer state sharded
  by ``NamedSharding`` annotations (what flax's ``optimizer_sharding`` and MaxText's
  ``shard_optimizer_over_data`` do);
- (c) ``zeroshard-jit``: the one-line drop-in, ``zs.sharded(inner, mesh=mesh)`` in the
  same plain ``jax.jit`` step as (b): ``jax.grad`` reduces the gradient, each device
  cuts its part out, updates it and all-gathers the new weights;
- (d) ``zeroshard-1``, ``zeroshard-2``, ``zeroshard-3``: zeroshard's own step, the three
  stages (a reduce-scatter of the local gradients in ``shard_map``).

``--quantize`` adds zeroshard's step with quantized collectives (``-int8``: int8
gradients and weights, ``-int4``: int4 gradients, int8 weights) and prints their ring
bytes over the exact step's. ``--deterministic M`` adds it with every sum in the fixed
order of ``deterministic=M`` (``-fixed``: the same bits on any device count dividing
``M``) and prints its ring bytes and step time over the default step's.

``--model-axis K`` runs every variant on a 2-D mesh of ``N / K`` data x ``K`` model
devices (``AxisType.Auto``): the batch split over ``"data"``, and every parameter of
two or more dimensions whose last one divides by ``K`` laid out over ``"model"``
(tensor parallelism; the compiler partitions the loss around it). Replicated data
parallelism keeps the state whole on every device; jit + NamedSharding lays each state
leaf out like its parameter, plus ``"data"`` on its first other dimension that divides
(MaxText's FSDP x TP); the drop-in and zeroshard's step split it over every device
(stage 3: over ``"data"``).

``--optimizer muon`` runs ``optax.contrib.muon`` instead of Adam: replicated data
parallelism orthogonalises every matrix on every device; zeroshard places each matrix
whole on one device (owned), which orthogonalises only its own.

``--model dense`` (default) is a list of tanh layers of the given width. ``--model
stacked`` is a pre-norm transformer whose blocks are stacked along a leading layer
axis and applied with ``jax.lax.scan`` (blocks ``qkv`` (L, d, 3d), ``out`` (L, d, d),
``up`` (L, d, 4d), ``down`` (L, 4d, d), ``ln1``/``ln2`` (L, d); an embedding (vocab, d),
a final norm and a head (d, vocab)); zeroshard gets ``stacked=["blocks"]`` and runs
stages 1 and 3. ``--model embed`` is unscanned: an embedding (vocab, d) looked up,
``args.layers`` residual GELU MLPs (d, 4d), (4d, d) and a head (d, 256) (with
``--vocab`` about 20 d the embedding is ~45% of the parameters; under the default
muon every 2-D leaf, the embedding included, is a matrix). With muon, each layer of
a block stack is its own matrix (``MuonDimensionNumbers(reduction_axis=1,
output_axis=2)``; the embedding, head and norms take muon's AdamW fallback), and
zeroshard with ``optax.adamw`` on the same model is added (``zeroshard-1-adamw``,
``zeroshard-3-adamw``).

Per variant: optimizer-state + master bytes per device (live arrays), XLA's argument,
temp, output and alias bytes, the collectives of the compiled step with their
ring-normalised bytes (one inside a loop counted once per iteration, e.g. per layer
of a scan), and the median step time (variants interleaved step by step,
after a warm-up); for zeroshard, the most a device holds over plain optax's state / N
and, where leaves are owned, who owns what and the owners' update cost max/mean (from
the plan). Prints markdown tables, writes JSON and a PNG.

    .venv/bin/python benchmarks/compare.py --devices 1 2 4 8 --widths 256 512 1024
    .venv/bin/python benchmarks/compare.py --optimizer muon --layers 8 --widths 256
    .venv/bin/python benchmarks/compare.py --optimizer muon --model stacked --devices 8 \\
        --widths 256 --layers 8 --batch 16 --seq 32 --steps 10 --warmup 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from typing import Any, NamedTuple


class Model(NamedTuple):
    """A model to train: its parameters, its loss per stage and its global batch."""

    params: Any
    make_loss: Any  # stage -> loss_fn(params, batch)
    batch: Any  # numpy Generator -> the global batch
    stacked: Any  # zs.sharded's ``stacked``
    muon_dims: Any  # muon's ``muon_weight_dimension_numbers`` (None: every 2-D leaf)
    stages: tuple[int, ...]  # the stages of zeroshard's own step to run


class Variant(NamedTuple):
    """One way to train the model: ``run(state) -> state`` and ``lower(state)``."""

    run: Any
    lower: Any
    state: Any
    opt_of: Any  # state -> its optimizer state and master weights
    tx: Any = None  # zeroshard's transformation (for its plan); None for plain optax
    inner: Any = None  # the optax optimizer it runs


def main() -> None:
    args = parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", max(args.devices))
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    machine = (
        f"{jax.devices()[0].device_kind} x{jax.device_count()} "
        f"({platform.machine()}, {os.cpu_count()} CPUs), jax {jax.__version__}"
    )
    results = []
    for width in args.widths:
        rng = np.random.default_rng(0)
        build = {"dense": dense_model, "stacked": stacked_model, "embed": embed_model}
        model = build[args.model](args, width, rng)
        size = sum(x.size for x in jax.tree.leaves(model.params))
        for n in args.devices:
            mesh = make_mesh(n, args.model_axis)
            batch = jax.device_put(model.batch(rng), NamedSharding(mesh, P("data")))
            fns = variants(args, model, mesh, batch)
            rows = measure(args, fns, model.params, n, {"width": width, "params": size})
            results += rows.values()
            print_table(width, size, n, rows)
            print_plans(rows)
            print_variants(rows)
    write(args, machine, results)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--pack-bytes", type=int, default=None, help="zs.sharded's pack_bytes (default: its own)"
    )
    parser.add_argument("--optimizer", choices=["adam", "muon"], default="adam")
    parser.add_argument("--model", choices=["dense", "stacked", "embed"], default="dense")
    parser.add_argument("--vocab", type=int, default=512, help="stacked: vocabulary size")
    parser.add_argument("--seq", type=int, default=32, help="stacked: tokens per sequence")
    parser.add_argument(
        "--quantize",
        action="store_true",
        help="add zeroshard's step with int8 gradients + int8 weights (-int8) and int4 "
        "gradients + int8 weights (-int4), and their ring bytes over the exact step's",
    )
    parser.add_argument(
        "--deterministic",
        type=int,
        default=None,
        metavar="M",
        help="add zeroshard's step with deterministic=M (a power of two dividing --batch)",
    )
    parser.add_argument(
        "--model-axis",
        type=int,
        default=1,
        metavar="K",
        help="a 2-D mesh of N/K data x K model devices, weights tensor-parallel over model",
    )
    parser.add_argument("--out", default="benchmarks/results", help="JSON and PNG go here")
    return parser.parse_args()


def make_mesh(n: int, model_axis: int) -> Any:
    """N devices as ``("data",)``, or with ``model_axis > 1`` as ``(N / K, K)`` of
    ``("data", "model")``, Auto axes (the models' losses carry no sharding calls, which
    plain optax under ``jax.jit`` would need on jax 0.12's default Explicit axes)."""
    import jax
    from jax.sharding import AxisType

    if n % model_axis:
        raise SystemExit(f"--model-axis {model_axis} does not divide {n} devices")
    shape = (n,) if model_axis == 1 else (n // model_axis, model_axis)
    names = ("data", "model")[: len(shape)]
    auto = (AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=auto, devices=jax.devices()[:n])


def tensor_parallel(tree: Any, mesh: Any) -> Any:
    """``NamedSharding`` of every leaf: over ``"model"`` along its last dimension where
    the mesh has that axis, the leaf two or more dimensions and the last divides."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    k = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get("model", 1)

    def spec(x: Any) -> P:
        if k == 1 or len(x.shape) < 2 or x.shape[-1] % k:
            return P()
        return P(*(None,) * (len(x.shape) - 1), "model")

    return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tree)


def dense_model(args: argparse.Namespace, width: int, rng: Any) -> Model:
    """``args.layers`` tanh layers of ``width`` (a list of {"w", "b"}); MSE loss."""
    import jax.numpy as jnp

    import zeroshard as zs

    def dense(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    def make_loss(stage):
        apply = zs.layer(dense) if stage == 3 else dense

        def loss_fn(params, batch):
            x = batch["x"]
            for p in params["layers"]:
                x = apply(p, x)
            return jnp.mean((x - batch["y"]) ** 2)

        return loss_fn

    params = {
        "layers": [
            {
                "w": jnp.asarray(rng.normal(size=(width, width)) / width**0.5, jnp.float32),
                "b": jnp.zeros(width),
            }
            for _ in range(args.layers)
        ]
    }
    normal = lambda rng: jnp.asarray(rng.normal(size=(args.batch, width)), jnp.float32)
    batch = lambda rng: {"x": normal(rng), "y": normal(rng)}
    return Model(params, make_loss, batch, None, None, (1, 2, 3))


def stacked_model(args: argparse.Namespace, width: int, rng: Any) -> Model:
    """A pre-norm transformer of ``args.layers`` blocks stacked on a leading layer axis
    and scanned over; next-token cross-entropy on random tokens. Muon orthogonalises
    each layer of the block matrices on its own; the rest take its AdamW fallback."""
    import jax.numpy as jnp
    import numpy as np
    from optax.contrib import MuonDimensionNumbers

    d, layers, vocab = width, args.layers, args.vocab
    normal = lambda *s, scale=1.0: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    residual = 1 / (2 * layers) ** 0.5  # the projections into the residual stream
    params = {
        "embed": normal(vocab, d),
        "blocks": {
            "ln1": jnp.ones((layers, d)),
            "qkv": normal(layers, d, 3 * d, scale=d**-0.5),
            "out": normal(layers, d, d, scale=d**-0.5 * residual),
            "ln2": jnp.ones((layers, d)),
            "up": normal(layers, d, 4 * d, scale=d**-0.5),
            "down": normal(layers, 4 * d, d, scale=(4 * d) ** -0.5 * residual),
        },
        "ln_f": jnp.ones(d),
        "head": normal(d, vocab, scale=d**-0.5),
    }
    per_layer = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    blocks = {k: None if k.startswith("ln") else per_layer for k in params["blocks"]}
    dims = {"embed": None, "blocks": blocks, "ln_f": None, "head": None}

    def batch(rng):
        tokens = rng.integers(0, vocab, size=(args.batch, args.seq + 1), dtype=np.int32)
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    make_loss = functools.partial(transformer_loss, heads=max(1, d // 64))
    return Model(params, make_loss, batch, ["blocks"], dims, (1, 3))


def embed_model(args: argparse.Namespace, width: int, rng: Any) -> Model:
    """An unscanned model with a large embedding (see the module docstring); a mean
    squared error of the head's output on random tokens."""
    import jax
    import jax.numpy as jnp

    import zeroshard as zs

    d, vocab = width, args.vocab
    normal = lambda *s: jnp.asarray(rng.normal(size=s) * s[0] ** -0.5, jnp.float32)
    params = {"embed": normal(vocab, d), "head": normal(d, 256)}
    params |= {
        f"mlp{k}": {"up": normal(d, 4 * d), "down": normal(4 * d, d), "b": jnp.zeros(4 * d)}
        for k in range(args.layers)
    }

    def make_loss(stage: int) -> Any:
        def loss_fn(params, batch):
            p = zs.gather(params) if stage == 3 else params
            # (one-hot, not indexing: a gather from sharded indices needs an out_sharding
            # on an Explicit mesh, which the manual axis of zeroshard's step refuses)
            x = jax.nn.one_hot(batch["tokens"], vocab) @ p["embed"]
            for k in range(args.layers):
                m = p[f"mlp{k}"]
                x = x + jax.nn.gelu(x @ m["up"] + m["b"]) @ m["down"]
            return jnp.mean((x @ p["head"] - batch["y"]) ** 2)

        return loss_fn

    def batch(rng):
        tokens = rng.integers(0, vocab, size=(args.batch,), dtype=jnp.int32)
        return {"tokens": tokens, "y": jnp.asarray(rng.normal(size=(args.batch, 256)), jnp.float32)}

    return Model(params, make_loss, batch, None, None, (1, 3))


def transformer_loss(stage: int, heads: int, remat: Any = None, prefetch: bool = False) -> Any:
    """The stacked model's loss; in stage 3 it gathers the embedding and the head whole
    and each block inside the scan (one layer per iteration; ``prefetch``: by
    ``zs.layers``, the next layer's weights gathered while a layer runs); with a
    ``remat`` policy, the block under ``jax.checkpoint(block, policy=remat)``. Blocks
    given as a list (an unrolled model) run one after the other in a Python loop, each
    through the same ``block``."""
    import jax
    import optax

    import zeroshard as zs

    block = functools.partial(transformer_block, heads=heads)
    block = zs.layer(block) if stage == 3 else block
    block = block if remat is None else jax.checkpoint(block, policy=remat)
    whole = zs.gather if stage == 3 else lambda p: p

    def loss_fn(params, batch):
        embed = whole(params["embed"])  # a one-hot matmul: a lookup on the batch-sharded
        x = jax.nn.one_hot(batch["tokens"], embed.shape[0]) @ embed  # tokens needs out_sharding
        if isinstance(params["blocks"], list):
            for p in params["blocks"]:
                x = block(p, x)
        elif prefetch and stage == 3:
            x = zs.layers(functools.partial(transformer_block, heads=heads))(params["blocks"], x)
        else:
            x, _ = jax.lax.scan(lambda x, p: (block(p, x), None), x, params["blocks"])
        head = whole({"ln": params["ln_f"], "w": params["head"]})
        logits = rms_norm(x, head["ln"]) @ head["w"]
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return losses.mean()

    return loss_fn


def transformer_block(p: dict, x: Any, heads: int) -> Any:
    """One pre-norm block: causal self-attention, then a GELU MLP, both residual."""
    import jax

    b, s, d = x.shape
    q, k, v = jax.numpy.split(rms_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(b, s, heads, d // heads)
    attention = jax.nn.dot_product_attention(split(q), split(k), split(v), is_causal=True)
    x = x + attention.reshape(b, s, d) @ p["out"]
    return x + jax.nn.gelu(rms_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def rms_norm(x: Any, scale: Any) -> Any:
    import jax

    return x * jax.lax.rsqrt(jax.numpy.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def variants(args: argparse.Namespace, model: Model, mesh: Any, batch: Any) -> dict:
    """name -> Variant: (a) replicated, (b) jit-sharded (Adam only), the drop-in and
    zeroshard's own step; with muon on the stacked model, zeroshard AdamW too."""
    import optax

    if args.optimizer == "adam":
        inner = optax.adam(1e-4)
    else:
        inner = optax.contrib.muon(1e-4, muon_weight_dimension_numbers=model.muon_dims)
    out = {"replicated": replicated(model, inner, mesh, batch)}
    # Plain muon under jit with a sharded state fails on Explicit mesh axes (its
    # Newton-Schulz matmul "produces an illegally sharded result"): left out.
    if args.optimizer == "adam":
        out["jit-sharded"] = jit_sharded(model, inner, mesh, batch)
    options = {"axis_name": "data", "stacked": model.stacked}
    options |= {} if args.pack_bytes is None else {"pack_bytes": args.pack_bytes}
    out["zeroshard-jit"] = dropin(model, inner, mesh, batch, options)
    out |= own_steps(model, inner, mesh, batch, options, "")
    if args.optimizer == "muon" and args.model == "stacked":
        out |= own_steps(model, optax.adamw(1e-4), mesh, batch, options, "-adamw")
    if args.deterministic:
        fixed = options | {"deterministic": args.deterministic}
        out |= own_steps(model, inner, mesh, batch, fixed, "-fixed")
    for grads in ("int8", "int4") if args.quantize else ():
        quantized = options | {"quantize_grads": grads, "quantize_weights": "int8"}
        out |= own_steps(model, inner, mesh, batch, quantized, f"-{grads}")
    return out


def replicate(tree: Any, mesh: Any) -> Any:
    """A fresh copy of ``tree`` on every device of ``mesh`` (each variant its own)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=NamedSharding(mesh, P()))
    return copy(tree)


def laid_out(tree: Any, mesh: Any) -> Any:
    """A fresh copy of ``tree`` on ``mesh``, tensor-parallel where :func:`tensor_parallel`
    says (replicated on a 1-D mesh)."""
    import jax
    import jax.numpy as jnp

    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=tensor_parallel(tree, mesh))
    return copy(tree)


def replicated(model: Model, inner: Any, mesh: Any, batch: Any) -> Variant:
    """(a): ``shard_map`` + ``pmean``, plain optax on every device."""
    from baseline import replicated_step

    dp = replicated_step(model.make_loss(1), inner, mesh)
    state = (replicate(model.params, mesh), replicate(inner.init(model.params), mesh))
    return Variant(lambda s: dp(*s, batch), lambda s: dp.lower(*s, batch), state, lambda s: s[1])


def jit_sharded(model: Model, inner: Any, mesh: Any, batch: Any) -> Variant:
    """(b): plain optax under ``jax.jit``, its state sharded by ``NamedSharding``."""
    import jax
    from baseline import jit_sharded_step, state_shardings

    opt_shardings = state_shardings(inner, model.params, mesh, tensor_parallel)
    params = tensor_parallel(model.params, mesh)
    js = jit_sharded_step(model.make_loss(1), inner, mesh, opt_shardings, params)
    opt = jax.jit(inner.init, out_shardings=opt_shardings)(model.params)
    state = (laid_out(model.params, mesh), opt)
    return Variant(lambda s: js(*s, batch), lambda s: js.lower(*s, batch), state, lambda s: s[1])


def dropin(model: Model, inner: Any, mesh: Any, batch: Any, options: dict) -> Variant:
    """(c) ``zeroshard-jit``: ``zs.sharded(inner, mesh=mesh)`` in the user's own jit step."""
    import jax
    import optax

    import zeroshard as zs

    tx, loss_fn = zs.sharded(inner, mesh=mesh, **options), model.make_loss(1)

    def dropin_step(p, s, b):  # the user's own jit step; only the optimizer differs
        updates, s = tx.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, updates), s

    ds = jax.jit(dropin_step, donate_argnums=(0, 1))
    params = laid_out(model.params, mesh)
    return Variant(
        lambda s: ds(*s, batch),
        lambda s: ds.lower(*s, batch),
        (params, tx.init(params)),
        lambda s: (s[1].inner_state, s[1].master, s[1].owned),
        tx,
        inner,
    )


def own_steps(model: Model, inner, mesh, batch, options: dict, suffix: str) -> dict:
    """(d) ``zeroshard-{stage}{suffix}``: zeroshard's own step, per stage of the model."""
    import zeroshard as zs

    tx, out = zs.sharded(inner, **options), {}
    for stage in model.stages:
        step = zs.make_train_step(model.make_loss(stage), tx, mesh, stage=stage)
        out[f"zeroshard-{stage}{suffix}"] = Variant(
            lambda s, step=step: step(s, batch)[0],
            lambda s, step=step: step.lower(s, batch),
            # (on a 2-D mesh the weights laid out over "model": the step keeps that)
            zs.init_train_state(laid_out(model.params, mesh), tx, mesh, stage=stage),
            lambda s: (s.opt_state.inner_state, s.opt_state.master, s.opt_state.owned),
            tx,
            inner,
        )
    return out


def measure(args: argparse.Namespace, fns: dict, params: Any, n: int, base: dict) -> dict:
    """name -> row: the compiled step's memory and collectives, the plan's figures, and
    the median step time (variants interleaved step by step after the warm-up)."""
    import jax

    rows = {
        name: describe(v, params, n, base | {"devices": n, "variant": name})
        for name, v in fns.items()
    }
    states = {name: v.state for name, v in fns.items()}
    for i in range(args.warmup + args.steps):
        for name, v in fns.items():
            t0 = time.perf_counter()
            states[name] = jax.block_until_ready(v.run(states[name]))
            if i >= args.warmup:
                rows[name]["times"].append(time.perf_counter() - t0)
    for row in rows.values():
        row["step_ms"] = 1e3 * statistics.median(row.pop("times"))
    return rows


def describe(v: Variant, params: Any, n: int, row: dict) -> dict:
    """``row`` with the compiled step's bytes and collectives, and for zeroshard the plan's
    placement: the owner of each owned leaf, owned bytes and update cost per device."""
    import jax

    import zeroshard as zs

    compiled = v.lower(v.state).compile()
    stats = compiled.memory_analysis()
    kinds = zs.summarize(step_collectives(compiled.as_text(), n))
    row |= {
        "opt_state_bytes": zs.state_bytes_per_device(v.opt_of(v.state)),
        "argument_bytes": stats.argument_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "collectives": {k: c["count"] for k, c in kinds.items()},
        "ring_bytes": sum(c["ring_bytes"] for c in kinds.values()),
        "times": [],
    }
    if v.tx is None:
        return row
    plan = v.tx.plan(params, n)
    plain = jax.eval_shape(v.inner.init, params)
    return row | {
        "plain_state_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(plain)),
        # The owner of each owned leaf, or of each layer of a layer-owned one.
        "owned": {
            s.path: s.owner if s.owner is not None else list(s.owners)
            for s in plan.layout.slots
            if s.owned
        },
        "owned_bytes": plan.owned_bytes(),
        "owned_costs": plan.owned_costs(),
    }


def step_collectives(hlo: str, n: int) -> list:
    """The collectives one step runs: those of each computation of the compiled HLO,
    times the known trip counts of the loops that run it (a ``lax.scan`` over layers
    runs its body's collectives once per layer; ``zs.compiled_collectives`` lists them once)."""
    import re

    import zeroshard as zs

    bodies: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        if header := re.match(r"(?:ENTRY )?%([\w.\-]+) \(.*\{$", line):
            lines = bodies.setdefault(header[1], [])
        elif bodies:
            lines.append(line)
    caller = {}  # computation -> (the computation calling it, times per call)
    for name, lines in bodies.items():
        for line in lines:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            for ref in re.findall(r"%([\w.\-]+)", line):
                if ref in bodies and ref not in caller:
                    caller[ref] = (name, int(trips[1]) if trips and f"body=%{ref}" in line else 1)

    def runs(name, seen=()):
        if name not in caller or name in seen:
            return 1
        parent, times = caller[name]
        return times * runs(parent, (*seen, name))

    return [
        c
        for name, lines in bodies.items()
        for c in zs.compiled_collectives("\n".join(lines), n) * runs(name)
    ]


def state_vs_plain(r: dict) -> str:
    """The most one device holds, over plain optax's state / N."""
    if "plain_state_bytes" not in r:
        return "-"
    return f"{r['opt_state_bytes'] * r['devices'] / r['plain_state_bytes']:.2f}"


def imbalance(r: dict) -> str:
    """The owners' update cost, max over mean across devices (as zeroshard logs it)."""
    costs = r.get("owned_costs") or [0]
    return f"{max(costs) * len(costs) / sum(costs):.2f}" if sum(costs) else "-"


def print_table(width, size, n, rows):
    a, b = rows["replicated"], rows.get("jit-sharded", rows["replicated"])
    print(f"\n### width {width} ({size:,} params), {n} devices\n")
    print(
        "| variant | opt+master B | arg B | temp B | collectives | ring B | step ms "
        "| state vs (a) | ring vs (a) | ring vs (b) | time vs (a) | time vs (b) "
        "| max state / (plain/N) | owned cost max/mean |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratio = lambda x, y: f"{x / y:.3f}" if y else "-"
    for name, r in rows.items():
        kinds = ", ".join(f"{k} x{c}" for k, c in sorted(r["collectives"].items())) or "none"
        print(
            f"| {name} | {r['opt_state_bytes']:,} | {r['argument_bytes']:,} | "
            f"{r['temp_bytes']:,} | {kinds} | {r['ring_bytes']:,.0f} | {r['step_ms']:.2f} | "
            f"{ratio(r['opt_state_bytes'], a['opt_state_bytes'])} | "
            f"{ratio(r['ring_bytes'], a['ring_bytes'])} | "
            f"{ratio(r['ring_bytes'], b['ring_bytes'])} | "
            f"{ratio(r['step_ms'], a['step_ms'])} | {ratio(r['step_ms'], b['step_ms'])} | "
            f"{state_vs_plain(r)} | {imbalance(r)} |"
        )


def print_variants(rows: dict) -> None:
    """Each quantized or fixed-order step's ring bytes (and step time) over the
    default step's of its stage."""
    for name, r in rows.items():
        exact = rows.get(name.rsplit("-", 1)[0])
        if name.endswith(("-int8", "-int4", "-fixed")) and exact and exact["ring_bytes"]:
            ratio = r["ring_bytes"] / exact["ring_bytes"]
            time = r["step_ms"] / exact["step_ms"]
            print(
                f"{name}: ring bytes {r['ring_bytes']:,.0f} = {ratio:.3f} x the default step's; "
                f"step {r['step_ms']:.1f} ms = {time:.2f} x"
            )


def print_plans(rows: dict) -> None:
    """Per zeroshard plan with owned leaves: which device owns what, and the owned
    bytes per device (the variants of one inner optimizer share a plan)."""
    seen = set()
    for name, r in rows.items():
        if not r.get("owned"):
            continue
        owners = ", ".join(f"{path} -> {d}" for path, d in r["owned"].items())
        line = f"owners: {owners}; owned bytes per device: {r['owned_bytes']}"
        if line not in seen:
            seen.add(line)
            print(f"\n{name} (and the variants of the same optimizer): {line}")


def write(args: argparse.Namespace, machine: str, results: list) -> None:
    """The JSON and the PNG, named for the optimizer and the model."""
    suffix = "" if args.optimizer == "adam" else f"-{args.optimizer}"
    suffix += "" if args.model == "dense" else f"-{args.model}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"compare{suffix}.json"), "w") as f:
        json.dump(
            {
                "machine": machine,
                "optimizer": args.optimizer,
                "model": args.model,
                "steps": args.steps,
                "results": results,
            },
            f,
            indent=1,
        )
    plot(results, os.path.join(args.out, f"memory_vs_devices{suffix}.png"))
    print(
        f"\n{machine}, {args.optimizer}, {args.model} model; medians of {args.steps} "
        f"interleaved steps. Wrote {args.out}/compare{suffix}.json and "
        f"memory_vs_devices{suffix}.png"
    )


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["width"] for r in results})
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4), squeeze=False)
    for ax, width in zip(axes[0], widths, strict=True):
        rows = [r for r in results if r["width"] == width]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted(
                (r["devices"], r["argument_bytes"] + r["temp_bytes"])
                for r in rows
                if r["variant"] == variant
            )
            ax.plot([p[0] for p in pts], [p[1] / 1e6 for p in pts], "o-", label=variant)
        ax.set(
            xscale="log",
            xlabel="devices",
            ylabel="MB per device (arguments + temp)",
            title=f"width {width}, {rows[0]['params']:,} params",
        )
        ax.minorticks_off()
        ax.set_xticks(sorted({r["devices"] for r in rows}), sorted({r["devices"] for r in rows}))
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
