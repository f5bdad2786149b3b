"""Time to first step: zeroshard's step and drop-in against replicated data parallelism.

The model is an MLP of ``--width``-wide tanh layers (a weight and a bias per layer, so
``L`` leaves are ``L / 2`` layers), its parameters in ``--dtype`` (fp32 or bf16),
trained with AdamW on ``--devices`` devices. Every measurement runs in a fresh Python
process, so no jax cache from another variant helps (the persistent compilation cache
is off unless the environment turns it on).

- ``total``: what a user waits for, from parameters on the host to the first step's
  result: zeroshard's ``zs.init_train_state`` and first ``train_step(state, batch)``
  (``--stage`` 1 or 3; stage 3 applies each layer through ``zs.layer``); replicated
  data parallelism's jitted state copy + ``optax.adamw(...).init`` and first call of
  a jitted ``shard_map`` step with ``pmean`` (plain optax); ``gspmd``: plain optax
  under ``jax.jit`` with the optimizer state sharded by ``NamedSharding``;
  ``dropin``: zeroshard's one-line drop-in, ``tx.init`` and the user's own
  ``jax.jit`` step calling ``tx.update`` on the mean gradient (under
  ``jax.set_mesh``).
- ``breakdown`` (another fresh process per variant): the same work split into the
  placement analysis (``zeroshard.analysis.analyze``: the inner update traced and
  tagged leaf by leaf), the rest of the plan and layout (``make_plan`` less the
  analysis), the state init, tracing (``jitted.trace``), lowering, XLA's compile and
  the first run of the compiled step (each stage less the analysis and plan built
  within it), plus the number of instructions of the compiled HLO and some of their
  kinds, the inner optimizer's ``update`` calls (traces) and the leaves they saw,
  and ``retrace``: the step traced again for a batch of another size (the plan and
  the inner update's cached trace reused). ``--xla-passes`` adds XLA's time per HLO
  pass pipeline of the step's compile (from XLA's own log), the passes summed by name;
``--kernels`` the kernels XLA compiled for the step (from its object files: each
distinct kernel once; a kernel of its own per leaf is what made zeroshard's compile
slow on CPU).

``--optimizer lamb`` or ``clip`` (``clip_by_global_norm`` then AdamW) takes the path
where global sums are inserted into the inner update. ``--trees before=DIR after=DIR``
compares zeroshard source trees (each ``DIR`` holding a ``zeroshard/`` package, put
first on ``PYTHONPATH``), interleaved in one run (the step and the drop-in of each).
``--quantize`` runs zeroshard with int8 gradients and weights. Tables give medians
over ``--repeats`` fresh processes per cell, the variants interleaved.

    .venv/bin/python benchmarks/startup.py --leaves 64 512 2048 --no-gspmd --repeats 3
    .venv/bin/python benchmarks/startup.py --leaves 32 128 512 2048
    .venv/bin/python benchmarks/startup.py --leaves 32 512 --optimizer lamb \
        --trees before=../zs-before after=. --no-replicated --until lower
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

STAGES = ("analysis", "plan", "init", "trace", "retrace", "lower", "compile", "first run")
OPS = ("pad", "concatenate", "slice", "dynamic-slice", "copy", "reduce-scatter", "all-gather")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[32, 128, 512, 2048])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="params")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=1, help="zeroshard's")
    parser.add_argument("--no-gspmd", action="store_true", help="leave out jit + NamedSharding")
    parser.add_argument(
        "--xla-passes", action="store_true", help="(breakdown) XLA's time per HLO pass"
    )
    parser.add_argument(
        "--pack-bytes", type=int, default=None, help="zs.sharded's pack_bytes (default: its own)"
    )
    parser.add_argument(
        "--quantize",
        action="store_true",
        help="zeroshard with int8 gradients and weights (quantize_grads, quantize_weights)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per cell")
    parser.add_argument(
        "--no-breakdown", action="store_true", help="only the end-to-end time to first step"
    )
    parser.add_argument("--no-total", action="store_true", help="only the breakdown")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument(
        "--trees", nargs="+", default=[], metavar="LABEL=DIR", help="zeroshard trees to compare"
    )
    parser.add_argument("--no-replicated", action="store_true", help="zeroshard variants only")
    parser.add_argument("--no-dropin", action="store_true", help="leave out the drop-in")
    parser.add_argument(
        "--value-and-grad",
        action="store_true",
        help="add vg: the drop-in given tx.value_and_grad's gradient",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="(breakdown) count the step's compiled kernels"
    )
    parser.add_argument(
        "--until", choices=("lower", "run"), default="run", help="(breakdown) last stage"
    )
    parser.add_argument("--out", default="benchmarks/results", help="JSON goes here")
    # Internal: run one measurement in this process and print it as JSON.
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "MODE", "LEAVES"))
    parser.add_argument("--cprofile", default=None, help="(with --child) write pstats here")
    args = parser.parse_args()
    if args.child:
        variant, mode, leaves = args.child
        print(json.dumps(measure(args, variant, mode, int(leaves))))
        return

    results = []
    modes = ("total",) if args.no_breakdown else ("total", "breakdown")
    modes = ("breakdown",) if args.until == "lower" or args.no_total else modes
    trees = dict(t.split("=", 1) for t in args.trees)
    kinds = ("zeroshard",) if args.no_dropin else ("zeroshard", "dropin")
    kinds += ("vg",) if args.value_and_grad else ()
    variants = [f"{k}:{label}" for label in trees for k in kinds] or list(kinds)
    variants = variants if args.no_gspmd or args.no_replicated else ["gspmd", *variants]
    variants = variants if args.no_replicated else ["replicated", *variants]
    machine = None
    for leaves in args.leaves:
        for mode in modes:
            for _ in range(args.repeats):
                for variant in variants:
                    row = run_child(args, variant, mode, leaves, trees)
                    machine = row.pop("machine")
                    results.append(row)
                    print(
                        f"{leaves} leaves, {variant}, {mode}: {row['seconds']:.2f} s",
                        file=sys.stderr,
                    )
    print_tables(results, machine, args, variants)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "startup.json"), "w") as f:
        json.dump({"machine": machine, "results": results}, f, indent=1)


def run_child(args, variant: str, mode: str, leaves: int, trees: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, mode, str(leaves)]
    cmd += ["--devices", str(args.devices), "--width", str(args.width)]
    cmd += ["--batch", str(args.batch), "--optimizer", args.optimizer, "--until", args.until]
    cmd += ["--dtype", args.dtype, "--stage", str(args.stage)]
    if args.pack_bytes is not None:
        cmd += ["--pack-bytes", str(args.pack_bytes)]
    cmd += ["--quantize"] if args.quantize else []
    env = dict(os.environ)
    tree = trees.get(variant.partition(":")[2])
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), env.get("PYTHONPATH", "")])
    passes = args.xla_passes and mode == "breakdown"
    if passes:  # XLA logs each HLO pass's time at this verbosity
        env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1")
    dump = tempfile.mkdtemp() if args.kernels and mode == "breakdown" else None
    if dump:  # XLA writes each kernel it compiles (identical ones once) as an object file
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if dump:
        files = os.listdir(dump)
        row["kernels"] = sum(f".{row['hlo_module']}.obj-file." in f for f in files)
        shutil.rmtree(dump)
    if passes:
        row["xla_passes"] = pass_times(done.stderr)
    return row


def pass_times(log: str) -> dict[str, dict[str, float]]:
    """Seconds per HLO pass (summed over its runs), per compiled module, from XLA's
    ``hlo_pass_pipeline`` log."""
    out: dict[str, dict[str, float]] = {}
    module, unit = "?", {"us": 1e-6, "ms": 1e-3, "s": 1.0}
    for line in log.splitlines():
        m = re.search(r"pipeline on module (\S+):", line)
        module = m.group(1) if m else module
        m = re.search(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) ", line)
        if m:
            times = out.setdefault(module, {})
            times[m.group(1)] = times.get(m.group(1), 0.0) + float(m.group(2)) * unit[m.group(3)]
    return out


def measure(args, variant: str, mode: str, leaves: int) -> dict:
    """One measurement in this (fresh) process."""
    t_start = time.perf_counter()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from baseline import jit_sharded_step, replicated_step, state_shardings
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    t_import, cpu_import = time.perf_counter() - t_start, time.process_time()
    n, w = args.devices, args.width
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    rng = np.random.default_rng(0)
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    params = {
        f"layer{i:04d}": {
            "w": (rng.normal(size=(w, w)) / np.sqrt(w)).astype(dtype),
            "b": np.zeros(w, dtype),
        }
        for i in range(leaves // 2)
    }
    batch = {
        "x": rng.normal(size=(args.batch, w)).astype(np.float32),
        "y": rng.normal(size=(args.batch, w)).astype(np.float32),
    }

    def dense(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    zeroshard = not variant.startswith(("replicated", "gspmd"))
    gathered = args.stage == 3 and zeroshard  # stage-3 pieces
    apply = zs.layer(dense) if gathered else dense

    def loss_fn(p, b):
        x = b["x"].astype(dtype)
        for i in range(leaves // 2):
            x = apply(p[f"layer{i:04d}"], x)
        return jnp.mean((x.astype(jnp.float32) - b["y"]) ** 2)

    halved = jax.tree.map(lambda x: x[: len(x) // 2], batch)  # to trace the step again
    counts = {"inner_traces": 0, "inner_leaves": 0}
    inner = counted(OPTIMIZERS[args.optimizer](optax), counts)
    times: dict[str, float] = dict.fromkeys(("analysis", "plan"), 0.0) if zeroshard else {}
    spent = instrument(times) if zeroshard else {}
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()

    def lap(name: str, t0: float) -> float:
        """Times stage ``name`` from ``t0``, less the analysis and plan built within
        it (counted apart)."""
        t1 = time.perf_counter()
        inside = spent.pop("analysis", 0.0), spent.pop("plan", 0.0)
        times[name] = t1 - t0 - inside[1]
        if zeroshard:
            times["analysis"] += inside[0]
            times["plan"] += inside[1] - inside[0]
        return t1

    t0 = time.perf_counter()
    pack = {} if args.pack_bytes is None else {"pack_bytes": args.pack_bytes}
    if args.quantize:
        pack |= {"quantize_grads": "int8", "quantize_weights": "int8"}
    placed_on = lambda tree: jax.device_put(tree, NamedSharding(mesh, P("data")))
    if variant.startswith("zeroshard"):
        tx = zs.sharded(inner, axis_name="data", **pack)
        state = jax.block_until_ready(zs.init_train_state(params, tx, mesh, stage=args.stage))
        t0 = lap("init", t0)
        train_step = zs.make_train_step(loss_fn, tx, mesh, stage=args.stage)
        if mode == "total":
            out = jax.block_until_ready(train_step(state, batch))
            lap("first step", t0)
        else:
            args_ = ((state, placed_on(batch), None), (state, placed_on(halved), None))
            out, sizes = staged(train_step.jitted, args_, lap, t0, args.until)
    elif variant.startswith(("dropin", "vg")):
        tx = zs.sharded(inner, axis_name="data", stage=args.stage, **pack)
        grad = jax.grad(loss_fn)
        if variant.startswith("vg"):  # (zeroshard's gradient in the user's step)
            grad = lambda p, b: tx.value_and_grad(loss_fn)(p, b)[1]

        def user_step(p, s, b):
            updates, s = tx.update(grad(p, b), s, p)
            return optax.apply_updates(p, updates), s

        with jax.set_mesh(mesh):
            whole = jax.device_put(params, NamedSharding(mesh, P()))
            if args.stage == 3:
                whole = tx.shard_params(whole)
            state = jax.block_until_ready(tx.init(whole))
            t0 = lap("init", t0)
            step = jax.jit(user_step, donate_argnums=(0, 1))
            if mode == "total":
                out = jax.block_until_ready(step(whole, state, placed_on(batch)))
                lap("first step", t0)
            else:
                args_ = ((whole, state, placed_on(batch)), (whole, state, placed_on(halved)))
                out, sizes = staged(step, args_, lap, t0, args.until)
    else:
        replicated = NamedSharding(mesh, P())
        if variant == "replicated":
            shardings = (replicated, replicated)
            dp = replicated_step(loss_fn, inner, mesh)
        else:  # gspmd
            shardings = (replicated, state_shardings(inner, params, mesh))
            dp = jit_sharded_step(loss_fn, inner, mesh, shardings[1])
        init = jax.jit(
            lambda p: (jax.tree.map(jnp.copy, p), inner.init(p)), out_shardings=shardings
        )
        state = jax.block_until_ready(init(params))
        t0 = lap("init", t0)
        placed = placed_on(batch)
        if mode == "total":
            out = jax.block_until_ready(dp(*state, placed))
            lap("first step", t0)
        else:
            out, sizes = staged(
                dp, ((*state, placed), (*state, placed_on(halved))), lap, t0, args.until
            )
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.cprofile)
    del out
    row = {
        "variant": variant,
        "optimizer": args.optimizer,
        "zeroshard": os.path.dirname(os.path.dirname(os.path.abspath(zs.__file__))),
        "mode": mode,
        "leaves": leaves,
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "devices": n,
        "import_s": t_import,
        "times": times,
        "seconds": sum(times.values()),
        "cpu_s": time.process_time() - cpu_import,
        **counts,
        "machine": (
            f"{jax.devices()[0].device_kind} x{jax.device_count()} "
            f"({platform.machine()}, {os.cpu_count()} CPUs), jax {jax.__version__}"
        ),
    }
    if mode == "breakdown":
        row.update(sizes)
    return row


def counted(inner, counts: dict):
    """``inner`` with each call of its ``update`` (each trace, under ``jax.jit``) and
    the leaves it got counted in ``counts``."""
    import jax
    import optax

    def update(updates, state, params=None, **extra):
        counts["inner_traces"] += 1
        counts["inner_leaves"] += len(jax.tree.leaves(updates))
        return inner.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def instrument(times: dict) -> dict:
    """Wraps zeroshard's placement analysis (``analyze``) and plan builder
    (``make_plan``, which runs the analysis) wherever a zeroshard module holds them,
    so that each call adds its seconds to the returned dict (``"analysis"``,
    ``"plan"``), which ``lap`` takes out of the stage they ran in."""
    spent: dict[str, float] = {}
    keys = {"analyze": "analysis", "make_plan": "plan"}
    modules = [m for k, m in sys.modules.items() if k.split(".")[0] == "zeroshard"]
    found = {
        f: keys[name]
        for m in modules
        for name in keys
        if callable(f := getattr(m, name, None)) and f.__module__.startswith("zeroshard")
    }

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

        return wrapper

    wrapped = {f: timed(f, key) for f, key in found.items()}
    for m in modules:
        for name in keys:
            f = getattr(m, name, None)
            if f in wrapped:
                setattr(m, name, wrapped[f])
    return spent


def staged(jitted, args: tuple, lap, t0: float, until: str = "run") -> tuple[object, dict]:
    """Traces, lowers, compiles and runs ``jitted(*args[0])``, timing each stage (and
    a second trace, for ``args[1]``); returns the output and the size of the program
    at each stage (up to lowering, with ``until="lower"``)."""
    import jax

    traced = jitted.trace(*args[0])
    t0 = lap("trace", t0)
    jitted.trace(*args[1])
    t0 = lap("retrace", t0)
    lowered = traced.lower()
    t0 = lap("lower", t0)
    sizes = {"jaxpr_eqns": count_eqns(traced.jaxpr.jaxpr)}
    sizes["stablehlo_lines"] = lowered.as_text().count("\n")
    if until == "lower":
        return None, {**sizes, "hlo_instructions": 0, "hlo_ops": dict.fromkeys(OPS, 0)}
    compiled = lowered.compile()
    t0 = lap("compile", t0)
    out = jax.block_until_ready(compiled(*args[0]))
    lap("first run", t0)
    ops = re.findall(r"=\s*\S+(?:\{[^}]*\})?\s+([a-z][\w-]*)\(", compiled.as_text())
    return out, {
        **sizes,
        "hlo_instructions": len(ops),
        "hlo_module": re.search(r"HloModule (\S+?),", compiled.as_text()).group(1),
        "hlo_ops": {op: sum(o == op for o in ops) for op in OPS},
    }


def count_eqns(jaxpr) -> int:
    """Equations of ``jaxpr``, counting those of nested jaxprs (shard_map, pjit, ...)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns") and hasattr(sub, "invars"):
                    total += count_eqns(sub)
    return total


def print_tables(results: list[dict], machine: str, args, variants: list[str]) -> None:
    by = {}
    for r in results:
        by.setdefault((r["leaves"], r["mode"], r["variant"]), []).append(r)
    med = lambda rows, key: statistics.median(r["times"].get(key, 0.0) for r in rows)
    total = lambda rows: statistics.median(r["seconds"] for r in rows)
    cpu = lambda rows: statistics.median(r["cpu_s"] for r in rows)
    leaves_list = sorted({r["leaves"] for r in results})
    base = variants[0]  # replicated, unless left out
    print(
        f"\n### Time to first step, {args.devices} devices, {args.width}-wide layers, "
        f"{args.optimizer}, {args.dtype} params, zeroshard stage {args.stage}\n\n{machine}; "
        f"one fresh process per measurement, variants interleaved, median of {args.repeats}; "
        f"wall s (CPU s); ratio: over {base}, wall (CPU)\n"
    )
    others = variants[1:]
    if any(r["mode"] == "total" for r in results):
        print(
            "| leaves | params | "
            + " | ".join(f"{v} s (CPU)" for v in variants)
            + "".join(f" | {v} ratio" for v in others)
            + " |"
        )
        print("|---:|---:|" + "---:|" * (len(variants) + len(others)))
        for leaves in leaves_list:
            rows = [by[leaves, "total", v] for v in variants]
            cells = " | ".join(f"{total(r):.2f} ({cpu(r):.2f})" for r in rows)
            b = rows[0]
            ratios = "".join(
                f" | {total(r) / total(b):.2f} ({cpu(r) / cpu(b):.2f})" for r in rows[1:]
            )
            print(f"| {leaves} | {rows[0][0]['params']:,} | {cells}{ratios} |")
    if not any(r["mode"] == "breakdown" for r in results):
        return
    print(
        "\n### Where the time goes (seconds, medians; analysis: the placement analysis, "
        "plan: the rest of the plan and layout, each taken out of the stage it ran in; "
        "inner traces: the inner optimizer's update calls (leaves they saw); HLO: "
        "instructions of the compiled step; kernels: those XLA compiled for it, each "
        "distinct one once, with --kernels)\n"
    )
    print(
        "| leaves | variant | "
        + " | ".join(STAGES)
        + " | sum | inner traces | jaxpr eqns | HLO instr | kernels | "
        + " | ".join(OPS)
        + " |"
    )
    print("|---:|---|" + "---:|" * (len(STAGES) + 5 + len(OPS)))
    for leaves in leaves_list:
        for variant in variants:
            rows = by[leaves, "breakdown", variant]
            cells = " | ".join(
                f"{med(rows, s):.2f}" if s in rows[0]["times"] else "-" for s in STAGES
            )
            ops = " | ".join(str(rows[0]["hlo_ops"][op]) for op in OPS)
            traces = f"{rows[0].get('inner_traces', 0)} ({rows[0].get('inner_leaves', 0):,})"
            print(
                f"| {leaves} | {variant} | {cells} | {total(rows):.2f} | {traces} | "
                f"{rows[0]['jaxpr_eqns']:,} | {rows[0]['hlo_instructions']:,} | "
                f"{rows[0].get('kernels', '-')} | {ops} |"
            )
    passes = [r for r in results if "xla_passes" in r]
    if passes:
        print_passes(passes)


def print_passes(results: list[dict], top: int = 6) -> None:
    """XLA's HLO-pass seconds in each variant's step (its costliest compiled module)."""
    step = lambda r: max(r["xla_passes"].values(), key=lambda t: sum(t.values()))
    totals: dict[str, float] = {}
    for r in results:
        for name, t in step(r).items():
            totals[name] = totals.get(name, 0.0) + t
    names = sorted(totals, key=lambda k: -totals[k])[:top]
    print("\n### XLA's HLO passes in the step's compile (seconds, one process each)\n")
    print("| leaves | variant | all passes | " + " | ".join(names) + " | other |")
    print("|---:|---|" + "---:|" * (len(names) + 2))
    for r in results:
        t = step(r)
        cells = " | ".join(f"{t.get(k, 0.0):.2f}" for k in names)
        other = sum(t.values()) - sum(t.get(k, 0.0) for k in names)
        print(f"| {r['leaves']} | {r['variant']} | {sum(t.values()):.2f} | {cells} | {other:.2f} |")


OPTIMIZERS = {
    "adamw": lambda optax: optax.adamw(1e-3),
    "lamb": lambda optax: optax.lamb(1e-3),
    "clip": lambda optax: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}


if __name__ == "__main__":
    main()
