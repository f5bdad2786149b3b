"""The largest model per device: each way to train, its compiled peak, against ZeRO.

Every variant trains the same scan-stacked transformer (``compare.py --model stacked``:
pre-norm blocks ``qkv`` (L, d, 3d), ``out`` (L, d, d), ``up`` (L, d, 4d), ``down``
(L, 4d, d), norms, an embedding and a head) with Adam, bf16 parameters and fp32 master
weights, on N devices:

- ``replicated``: data parallelism (``shard_map`` + ``pmean``), plain optax on every
  device's fp32 master copy (the ZeRO paper's baseline: 16 bytes per parameter);
- ``jit-sharded``: plain optax under ``jax.jit``, the master weights and moments laid
  out over ``"data"`` by ``NamedSharding`` (flax's ``optimizer_sharding``, MaxText);
- ``dropin``: ``zs.sharded(optax.adam(...), mesh=mesh)`` in the same ``jax.jit`` step
  (``-2``, ``-3``: at stages 2 and 3; ``dropin-vg``, ``-vg-2``, ``-vg-3``: its gradient taken by
  ``tx.value_and_grad``, not ``jax.grad``; ``dropin-reduced``: its matrices typed
  ``reduced`` over ``"data"``, the norms whole, always on Explicit axes, so that
  ``jax.grad`` leaves their gradients' partial sums to ``tx.update``; with
  ``--apply-gradients`` each steps with ``tx.apply_gradients``);
- ``zeroshard-1``, ``-2``, ``-3``: zeroshard's own step, stages 1-3; stages 2 and 3
  with the loss that gathers each block (``zs.layer`` in the scan: stage 2 then
  reduce-scatters each layer's gradient in the backward pass, ``zeroshard.training.held``),
  stage 1 with the plain one (``--prefetch``: stages 2 and 3 scan with ``zs.layers``,
  each layer's weights gathered while the layer before runs).

Per variant and size: the compiled step's per-device peak, ``arguments + outputs +
temporaries - aliased`` (``compiled.memory_analysis()``: per device for an SPMD
program), lowered on abstract values (``jax.ShapeDtypeStruct`` with their shardings:
nothing is allocated), in bytes per parameter beside the ZeRO formulas (mixed
precision, Adam, K = 12 bytes of fp32 state: replicated 16, stage 1 ``4 + 12/N``,
stage 2 ``2 + 14/N``, stage 3 ``16/N``). The drop-ins and ``jit-sharded`` run on
Auto axes, the others on Explicit ones (jax's default); ``--explicit`` puts them on
Explicit axes too (``gspmd-fsdp`` stays on Auto: :func:`make_mesh`). ``--budgets``
finds, per variant, the most layers (at ``--width``) whose compiled peak fits each
per-device budget (a binary search on compiled figures), and ``--real`` runs one real
training step at that size per variant, each in its own process, reporting the
process's peak RSS beside it.

    .venv/bin/python benchmarks/capacity.py --width 512 --layers 4 8 16 32
    .venv/bin/python benchmarks/capacity.py --model unrolled --layers 16 --explicit
    .venv/bin/python benchmarks/capacity.py --width 512 --budgets 512 1024 --real
    .venv/bin/python benchmarks/capacity.py --plot docs/images/capacity.png \
        --runs n2.json n4.json n8.json budget512.json budget1024.json

``--plot`` draws two panels from the JSONs runs wrote: bytes per parameter against the
device count (measured points, the ZeRO formulas as lines) and the largest model per
budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = (
    "replicated",
    "jit-sharded",
    "gspmd-fsdp",
    "dropin",
    "dropin-reduced",
    "dropin-2",
    "dropin-3",
    "dropin-vg",
    "dropin-vg-2",
    "dropin-vg-3",
    "zeroshard-1",
    "zeroshard-2",
    "zeroshard-3",
)
MiB = 2**20
# gspmd-fsdp's block: jax.checkpoint with the policy that gave it the lowest peak (16
# and 32 layers, jax 0.12; see docs/benchmarks.md).
REMAT_POLICY = "nothing_saveable"


def formula(variant: str, n: int) -> float | None:
    """The ZeRO paper's bytes per parameter (mixed precision, Adam) for ``variant``."""
    return {
        "replicated": 16.0,
        "zeroshard-1": 4 + 12 / n,
        "zeroshard-2": 2 + 14 / n,
        "zeroshard-3": 16 / n,
        "gspmd-fsdp": 16 / n,
        "dropin-3": 16 / n,
        "dropin-2": 2 + 14 / n,
        "dropin-vg-2": 2 + 14 / n,
        "dropin-vg-3": 16 / n,
        "dropin": 4 + 12 / n,
        "dropin-vg": 4 + 12 / n,
        "dropin-reduced": 4 + 12 / n,
        "jit-sharded": 4 + 12 / n,
    }.get(variant)


def gathering(stage: int) -> int:
    """The loss a zeroshard stage trains: stages 2 and 3 the one that gathers each block
    (``compare.transformer_loss(3, ...)``: ``zs.layer`` in the scan), so that stage 2
    reduce-scatters each layer's gradient in the backward pass (``zeroshard.training.held``);
    stage 1 the plain one."""
    return 3 if stage >= 2 else stage


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--model",
        choices=("stacked", "unrolled"),
        default="stacked",
        help="the blocks stacked and scanned over (stacked=), or a Python loop over L blocks",
    )
    parser.add_argument(
        "--explicit",
        action="store_true",
        help="jit-sharded and the drop-ins on Explicit axes too (jax.make_mesh's default)",
    )
    parser.add_argument(
        "--apply-gradients",
        action="store_true",
        help="the drop-ins step with tx.apply_gradients, not tx.update + optax.apply_updates",
    )
    parser.add_argument(
        "--state-bits",
        type=int,
        nargs="*",
        default=[],
        choices=(8, 4),
        help="zeroshard's variants again with the state in these bits (state_bits=)",
    )
    parser.add_argument(
        "--remat", default=REMAT_POLICY, help="gspmd-fsdp's jax.checkpoint_policies name"
    )
    parser.add_argument(
        "--prefetch", action="store_true", help="stages 2 and 3 scan with zs.layers (prefetch)"
    )
    parser.add_argument("--budgets", type=int, nargs="*", default=[], help="MiB per device")
    parser.add_argument("--real", action="store_true", help="one real step at each largest")
    parser.add_argument(
        "--one", nargs=3, metavar=("VARIANT", "LAYERS", "BITS"), help=argparse.SUPPRESS
    )
    parser.add_argument("--out", default="benchmarks/results", help="JSON goes here")
    parser.add_argument("--plot", help="draw this PNG from --runs (JSONs of earlier runs)")
    parser.add_argument("--runs", nargs="*", default=[])
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.plot:
        plot(args.plot, [json.loads(Path(path).read_text()) for path in args.runs])
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.one:  # (a child process: one real step)
        name, layers, bits = args.one
        print(json.dumps(real_step(args, name, int(layers), None if bits == "-" else int(bits))))
        return
    machine = f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.machine()}, "
    machine += f"{os.cpu_count()} CPUs), jax {jax.__version__}"
    print(
        f"{machine}; {args.model} model, width {args.width}, vocab {args.vocab}, "
        f"batch {args.batch}x{args.seq}, {'Explicit' if args.explicit else 'Auto'} axes "
        "in your jax.jit"
    )
    runs = [(v, bits) for v in args.variants for bits in [None, *args.state_bits] if coded(v, bits)]
    rows = [peak(args, v, layers, bits) for layers in args.layers for v, bits in runs]
    print_table(rows, args.devices)
    largest = [search(args, v, budget, bits) for budget in args.budgets for v, bits in runs]
    if largest:
        print_largest(largest, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        run = {"machine": machine, "devices": args.devices, "model": args.model}
        run |= {"explicit": args.explicit}
        run |= {"peaks": rows, "largest": largest}
        json.dump(run, f, indent=1)


def stacked(args: argparse.Namespace) -> list[str] | None:
    """``zs.sharded``'s ``stacked=`` for the model: its scanned blocks' leading axis."""
    return ["blocks"] if args.model == "stacked" else None


def coded(name: str, bits: int | None) -> bool:
    """Whether variant ``name`` runs with state in ``bits`` (``None``: as optax keeps it):
    the variants of ``zs.sharded`` (its ``state_bits=``) with any, the others with none."""
    return bits is None or name == "dropin" or name.startswith("zeroshard-")


def shapes(width: int, layers: int, vocab: int, model: str = "stacked") -> dict:
    """The parameters' shapes and dtype (fp32: the master weights' precision): the
    blocks stacked on a leading layer axis, or (``model="unrolled"``) a list of
    ``layers`` blocks, as a model written with a Python loop holds them."""
    import jax
    import jax.numpy as jnp

    d, f32 = width, jnp.float32
    s = lambda *shape: jax.ShapeDtypeStruct(shape, f32)
    block = lambda *lead: {
        "ln1": s(*lead, d),
        "qkv": s(*lead, d, 3 * d),
        "out": s(*lead, d, d),
        "ln2": s(*lead, d),
        "up": s(*lead, d, 4 * d),
        "down": s(*lead, 4 * d, d),
    }
    blocks = block(layers) if model == "stacked" else [block() for _ in range(layers)]
    return {"embed": s(vocab, d), "blocks": blocks, "ln_f": s(d), "head": s(d, vocab)}


def init_params(structs: dict, seed: int = 0) -> dict:
    """Random parameters of ``structs``: fan-in scaled normals, the norms at one."""
    import jax
    import jax.numpy as jnp

    paths, treedef = jax.tree_util.tree_flatten_with_path(structs)
    keys = jax.random.split(jax.random.key(seed), len(paths))

    def one(key: Any, path: Any, x: Any) -> Any:
        if "ln" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        return jax.random.normal(key, x.shape, x.dtype) * x.shape[-2] ** -0.5

    return jax.tree.unflatten(treedef, [one(k, *p) for k, p in zip(keys, paths, strict=True)])


def variant_step(
    args: argparse.Namespace, name: str, structs: dict, mesh: Any, bits: int | None = None
) -> tuple:
    """``(step, state)`` of ``name``: ``step(state, batch) -> state``, and its state as
    abstract values with their shardings (``jax.ShapeDtypeStruct``); the state of
    ``zs.sharded`` in ``bits`` (``state_bits=``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from compare import transformer_loss
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), structs)
    heads, inner = max(1, args.width // 64), optax.adam(1e-4)
    loss = lambda stage: transformer_loss(gathering(stage), heads, prefetch=args.prefetch)
    whole = NamedSharding(mesh, P())
    placed = lambda tree, sharding: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding
    )  # (one array and its sharding, or a tree and a tree of them)
    if name.startswith("zeroshard-"):
        stage = int(name[-1])
        tx = zs.sharded(inner, stacked=stacked(args), state_bits=bits)
        init = lambda p: zs.init_train_state(p, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
        step = zs.make_train_step(loss(stage), tx, mesh, stage=stage)
        lower = lambda s, b: step.jitted.lower(s, b, None)
        return (lambda s, b: step(s, b)[0]), on(mesh, jax.eval_shape(init, structs)), lower
    # (dropin-2, -3: zs.layer in the scan; 3: weights as pieces; -vg: tx.value_and_grad)
    if name.startswith("dropin"):
        stage = int(name[-1]) if name[-1].isdigit() else 1
        tx = zs.sharded(inner, mesh=mesh, stacked=stacked(args), state_bits=bits, stage=stage)
        params = placed(bf16, jax.tree.map(lambda _: whole, bf16))
        params = tx.shard_params(typed_reduced(params, mesh) if "reduced" in name else params)

        def dropin(p, s, b):
            if "-vg" in name:  # (zeroshard's gradient: tx.value_and_grad)
                grads = tx.value_and_grad(loss(stage))(p, b)[1]
            else:
                grads = jax.grad(loss(stage))(p, b)
            if args.apply_gradients:  # (the new weights themselves)
                return tx.apply_gradients(grads, s, p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        step = jax.jit(dropin, donate_argnums=(0, 1))
        specs = tx.state_specs(params, mesh.shape["data"])  # (Auto axes: the types say none)
        state = (
            params,
            jax.tree.map(
                lambda x, spec: placed(x, NamedSharding(mesh, spec)),
                jax.eval_shape(tx.init, params),
                specs,
            ),
        )
        return (lambda s, b: step(*s, b)), state, (lambda s, b: step.lower(*s, b))
    remat = getattr(jax.checkpoint_policies, args.remat) if name == "gspmd-fsdp" else None
    step, state = mixed_precision_step(
        name, transformer_loss(1, heads, remat), inner, structs, mesh
    )
    return step, state, step.lower


def mixed_precision_step(name: str, loss_fn: Any, inner: Any, structs: dict, mesh: Any) -> tuple:
    """Plain optax with fp32 master weights of bf16 parameters, as a JAX user writes it:
    the state ``(params, master, inner state)``; the gradient of the bf16 parameters,
    averaged, updates the master weights, and the parameters are their rounding.
    ``replicated``: ``shard_map`` + ``pmean``, everything on every device;
    ``jit-sharded``: ``jax.jit`` with the master and the moments split over ``"data"``
    (each leaf along its first dimension that divides, as flax's
    ``optimizer_sharding`` and MaxText lay them out); ``gspmd-fsdp``: the parameters
    too (XLA gathers them where used). The step donates its state."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    f32, bf16 = jnp.float32, jnp.bfloat16
    n, whole = mesh.shape["data"], NamedSharding(mesh, P())

    def update(params, master, opt, grads):
        grads = jax.tree.map(lambda g: g.astype(f32), grads)
        updates, opt = inner.update(grads, opt, master)
        master = optax.apply_updates(master, updates)
        return jax.tree.map(lambda m: m.astype(bf16), master), master, opt

    def spread(x: Any) -> Any:
        k = next((i for i, d in enumerate(x.shape) if d % n == 0), None)
        return (
            whole
            if name == "replicated" or k is None
            else NamedSharding(mesh, P(*(None,) * k, "data"))
        )

    abstract = jax.eval_shape(
        lambda p: (jax.tree.map(lambda x: x.astype(bf16), p), p, inner.init(p)), structs
    )
    params = jax.tree.map(spread if name == "gspmd-fsdp" else lambda _: whole, abstract[0])
    shardings = (params, *jax.tree.map(spread, abstract[1:]))
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )
    if name == "replicated":

        def local(state, batch):
            params, master, opt = state
            grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), batch)
            return update(params, master, opt, jax.lax.pmean(grads, "data"))

        run = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        return jax.jit(run, donate_argnums=0), state
    step = lambda state, batch: update(*state, jax.grad(loss_fn)(state[0], batch))
    rows = NamedSharding(mesh, P("data"))
    return jax.jit(
        step, in_shardings=(shardings, rows), out_shardings=shardings, donate_argnums=0
    ), state


def make_mesh(name: str, devices: int, explicit: bool = False) -> Any:
    """The 1-D ``"data"`` mesh of ``name``: by default Auto axes for the variants that
    train in a plain ``jax.jit`` (``jit-sharded``, the drop-ins), else jax's default
    (Explicit); with ``explicit`` (``--explicit``) every variant's on Explicit axes
    but ``gspmd-fsdp``'s, which stays on Auto axes: with its weights split over
    ``"data"`` the model as written multiplies them with batch-split activations, which
    Explicit axes refuse without a reshard at every use."""
    import jax
    from jax.sharding import AxisType

    plain = name == "jit-sharded" or name.startswith("dropin")
    auto = name == "gspmd-fsdp" or (plain and not explicit and name != "dropin-reduced")
    return jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,) if auto else None)


def on(mesh: Any, tree: Any) -> Any:
    """``tree``'s abstract values (as ``jax.eval_shape`` gives them, typed on the mesh's
    abstract twin) with their specs on ``mesh`` itself."""
    import jax
    from jax.sharding import NamedSharding

    put = lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)
    )
    return jax.tree.map(put, tree)


def batch_structs(args: argparse.Namespace, mesh: Any) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = NamedSharding(mesh, P("data"))
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32, sharding=rows)
    return {"tokens": tokens, "targets": tokens}


def peak(args: argparse.Namespace, name: str, layers: int, bits: int | None = None) -> dict:
    """The compiled per-device peak of ``name`` at ``layers`` layers (abstract values),
    its state in ``bits``."""
    import jax
    import jax.numpy as jnp
    import optax
    from compare import transformer_loss

    import zeroshard as zs

    mesh = make_mesh(name, args.devices, args.explicit)
    structs, batch = shapes(args.width, layers, args.vocab, args.model), batch_structs(args, mesh)
    count = sum(x.size for x in jax.tree.leaves(structs))
    start, stage = time.perf_counter(), int(name[-1]) if name.startswith("zeroshard-") else 0
    estimated = {
        "replicated": 0,
        "gspmd-fsdp": 3,
        "dropin-2": 2,
        "dropin-vg-2": 2,
        "dropin-3": 3,
        "dropin-vg-3": 3,
    }.get(name, stage or 1)
    if stage:  # zeroshard's planner: its step compiled on abstract values
        tx = zs.sharded(optax.adam(1e-4), stacked=stacked(args), state_bits=bits)
        loss = transformer_loss(gathering(stage), max(1, args.width // 64), prefetch=args.prefetch)
        stats = zs.step_memory(
            loss, tx, mesh, structs, batch, stage=stage, param_dtype=jnp.bfloat16
        )
    else:
        _, state, lower = variant_step(args, name, structs, mesh, bits)
        m = lower(state, batch).compile().memory_analysis()
        stats = zs.StepMemory(
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.temp_size_in_bytes,
            m.alias_size_in_bytes,
        )
    row = {"variant": name, "bits": bits, "layers": layers, "params": count} | stats._asdict()
    row |= {"peak": stats.peak, "compile_s": time.perf_counter() - start}
    # The model-state estimate (zs.estimate_memory: params, grads, state, master; no
    # temporaries), to say how far it is from the compiled peak.
    analytic = zs.estimate_memory(count, args.devices, stage=estimated)
    return row | {"model_state": analytic.total}


def state(row: dict) -> str:
    """How a row's optimizer state is stored."""
    return f"{row['bits']}-bit" if row.get("bits") else "fp32"


def print_table(rows: list[dict], n: int) -> None:
    base = {r["layers"]: r["peak"] for r in rows if r["variant"] == "replicated"}
    print(
        "\n| variant | state | layers | params | arguments | temporaries | peak / device | B/param "
        "| formula | vs replicated | model-state estimate |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rel = f"{r['peak'] / base[r['layers']]:.3f}x" if r["layers"] in base else "-"
        f = formula(r["variant"], n)
        print(
            f"| {r['variant']} | {state(r)} | {r['layers']} | {r['params'] / 1e6:.1f}M | "
            f"{r['arguments'] / MiB:.1f} MiB | {r['temporaries'] / MiB:.1f} MiB | "
            f"{r['peak'] / MiB:.1f} MiB | {r['peak'] / r['params']:.2f} | "
            f"{f:.2f} ({f / 16:.3f}x) | {rel} | {r['model_state'] / r['peak']:.2f}x peak |"
        )


def search(args: argparse.Namespace, name: str, budget: int, bits: int | None = None) -> dict:
    """The most layers whose compiled peak fits ``budget`` MiB, with that peak; and with
    ``--real`` one real step at that size. A stacked model's peak is affine in its
    layers (the scan's body is one program): two compiles give the line, then the
    fit is checked by compiling, one layer at a time."""
    fits = lambda layers: layers < 1 or peak(args, name, layers, bits)["peak"] <= budget * MiB
    a, b = (peak(args, name, layers, bits)["peak"] for layers in (4, 8))
    low = max(0, int((budget * MiB - a) / ((b - a) / 4)) + 4)
    while not fits(low):
        low -= 1
    while fits(low + 1):
        low += 1
    row = {"budget_mib": budget} | (
        peak(args, name, low, bits) if low else {"variant": name, "bits": bits, "layers": 0}
    )
    if args.real and low:
        command = [sys.executable, __file__, "--one", name, str(low), str(bits or "-")]
        command += ["--devices", str(args.devices), "--width", str(args.width)]
        command += ["--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch)]
        command += ["--prefetch"] * args.prefetch + ["--model", args.model]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            row |= json.loads(done.stdout.strip().splitlines()[-1])
        else:  # (killed by a signal: negative; the kernel's OOM killer sends SIGKILL)
            said = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            row["real_error"] = said[-1][:200]
    said = f"{name} ({bits or 'optax'} state): {budget} MiB -> {row['layers']} layers {row}"
    print(said, file=sys.stderr, flush=True)
    return row


def real_step(args: argparse.Namespace, name: str, layers: int, bits: int | None) -> dict:
    """One real step of ``name`` at ``layers`` layers: its time and the process's peak
    resident memory (``ru_maxrss``: all 8 simulated devices share this process)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    mesh = make_mesh(name, args.devices, args.explicit)
    structs = shapes(args.width, layers, args.vocab, args.model)
    run, abstract, _ = variant_step(args, name, structs, mesh, bits)
    start = time.perf_counter()
    state = materialize(name, abstract, structs, mesh, bits, stacked(args))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, size=(args.batch, args.seq + 1), dtype=np.int32)
    rows = NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = jax.device_put({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}, rows)
    made = time.perf_counter()
    state = jax.block_until_ready(run(state, batch))
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"init_s": made - start, "step_s": time.perf_counter() - made, "rss_mib": kib / 1024}


def materialize(
    name: str, abstract: Any, structs: dict, mesh: Any, bits: int | None, layers_of: Any = None
) -> Any:
    """Real arrays of a variant's state: zeroshard's from ``zs.init_train_state`` on
    random parameters, the others' from their optimizer's init, laid out as
    ``abstract`` says; ``layers_of``: ``zs.sharded``'s ``stacked=``."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    if name in ("zeroshard-3", "dropin-3", "gspmd-fsdp"):  # made split (whole, it would not fit)
        n = mesh.shape["data"]
        dim = lambda x: next((k for k, d in enumerate(x.shape) if d % n == 0), None)
        spec = lambda x: P() if dim(x) is None else P(*(None,) * dim(x), "data")
        split = lambda x: jax.sharding.NamedSharding(mesh, spec(x))
        fresh = jax.jit(lambda: init_params(structs), out_shardings=jax.tree.map(split, structs))()
    else:
        fresh = jax.jit(lambda: init_params(structs), out_shardings=_whole(mesh))()
    if name.startswith("zeroshard-"):
        tx = zs.sharded(optax.adam(1e-4), stacked=layers_of, state_bits=bits)
        return zs.init_train_state(fresh, tx, mesh, param_dtype=jnp.bfloat16, stage=int(name[-1]))
    if name.startswith("dropin"):
        stage = int(name[-1]) if name[-1].isdigit() else 1
        tx = zs.sharded(
            optax.adam(1e-4), mesh=mesh, stacked=layers_of, state_bits=bits, stage=stage
        )
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), fresh)
        bf16 = tx.shard_params(typed_reduced(bf16, mesh) if "reduced" in name else bf16)
        return bf16, tx.init(bf16)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    start = lambda p: (
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), p),
        p,
        optax.adam(1e-4).init(p),
    )
    return jax.jit(start, out_shardings=shardings)(fresh)


def typed_reduced(params: Any, mesh: Any) -> Any:
    """``params`` (arrays or abstract values) with their matrices (the norms' scales
    left whole) typed ``reduced`` over ``"data"``: ``jax.grad`` then leaves their
    gradients as the devices' partial sums."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def typed(path: Any, x: Any) -> Any:
        if "ln" in jax.tree_util.keystr(path):
            return x
        sharding = NamedSharding(mesh, P(*(None,) * x.ndim, reduced={"data"}))
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(typed, params)


def _whole(mesh: Any) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P())


def print_largest(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        "\n| budget | variant | state | layers | params | compiled peak | real step | process RSS |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        step = f"{r['step_s']:.1f} s" if "step_s" in r else r.get("real_error", "-")
        rss = f"{r['rss_mib']:.0f} MiB" if "rss_mib" in r else "-"
        print(
            f"| {r['budget_mib']} MiB | {r['variant']} | {state(r)} | {r['layers']} | "
            f"{r.get('params', 0) / 1e6:.1f}M | {r.get('peak', 0) / MiB:.0f} MiB | {step} | {rss} |"
        )


def plot(path: str, runs: list[dict]) -> None:
    """Bytes per parameter against N (the runs' peaks; the formulas as lines), and the
    largest model per budget (the runs' searches), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ns = sorted({r["devices"] for r in runs if r["peaks"]})
    for k, variant in enumerate(VARIANTS):
        color = f"C{k}"
        points = [
            (r["devices"], p)
            for r in runs
            for p in r["peaks"]
            if (p["variant"], p.get("bits")) == (variant, None)
        ]
        left.plot(
            [n for n, _ in points], [p["peak"] / p["params"] for _, p in points], "o", color=color
        )
        if variant in ("replicated", "zeroshard-1", "zeroshard-2", "zeroshard-3"):
            left.plot(ns, [formula(variant, n) for n in ns], "--", color=color, alpha=0.6)
        best = sorted(
            (r["budget_mib"], r.get("params", 0))
            for x in runs
            for r in x["largest"]
            if (r["variant"], r.get("bits")) == (variant, None)
        )
        right.plot(
            [b for b, _ in best], [p / 1e6 for _, p in best], "o-", color=color, label=variant
        )
    left.set(xlabel="devices N", ylabel="compiled peak / parameter (bytes)")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xticks(ns, [str(n) for n in ns])
    left.set_yticks([2, 4, 8, 16], ["2", "4", "8", "16"])
    left.minorticks_off()
    left.set_title("bytes per parameter (points: compiled; dashed: ZeRO formula)")
    right.set(xlabel="per-device budget (MiB)", ylabel="largest model (M parameters)")
    right.set_title("largest stacked transformer that fits, N = 8")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
