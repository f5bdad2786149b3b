"""Quantized collectives: the loss curves and wire bytes of exact, int8 and int4 runs.

Trains the demo's language model (``zeroshard.demo``: a character-level transformer on
the packaged text, bf16 parameters with fp32 masters, AdamW with global-norm clipping
and a cosine schedule) on N simulated devices three times from the same start on the
same batches: exact collectives, int8 gradients + int8 weights, int4 gradients + int8
weights (``zs.sharded(..., quantize_grads=, quantize_weights=)``); with ``--alone``
also each side alone. Per run: the loss
of every step, the final loss (the mean of the last ``--tail`` steps, the same batches
in every run; with ``--seeds``, averaged over that many data orders), its difference
from the exact run's (and, as the noise floor, that of an exact run reducing in fp32
instead of bf16, a perturbation of the size of bf16's rounding), and the ring bytes of the
step's collectives (``zs.lowered_collectives``: as JAX emits them, in their dtypes).
Writes JSON and a PNG of the three curves.

    .venv/bin/python benchmarks/quantized.py --steps 300 --stage 1
    .venv/bin/python benchmarks/quantized.py --steps 300 --stage 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

RUNS = {
    "exact": {},
    "int8 grads + int8 weights": {"quantize_grads": "int8", "quantize_weights": "int8"},
    "int4 grads + int8 weights": {"quantize_grads": "int4", "quantize_weights": "int8"},
}
DATA = {"corpus": "its 5 kB text", "markov": "fresh Markov text"}
FLOOR = {  # the spread of the final loss under a perturbation of bf16 rounding's size
    "exact, fp32 reduction": {"reduce_dtype": "float32"},
}
ALONE = {  # --alone: each side quantized alone
    "int8 grads": {"quantize_grads": "int8"},
    "int4 grads": {"quantize_grads": "int4"},
    "int8 weights": {"quantize_weights": "int8"},
}


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data``: what the demo's model trains on (benchmarks/lowbit.py's too)."""
    parser.add_argument(
        "--data",
        choices=["corpus", "markov"],
        default="corpus",
        help="the demo's packaged text (5 kB: memorised), or text drawn afresh every step "
        "from a fixed order-1 Markov chain over as many characters (never repeated)",
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=1)
    parser.add_argument("--tail", type=int, default=20, help="steps the final loss averages")
    parser.add_argument("--block", type=int, default=256, help="quantize_block")
    add_data_argument(parser)
    parser.add_argument("--alone", action="store_true", help="also each side quantized alone")
    parser.add_argument(
        "--seeds", type=int, default=1, help="data orders; the final loss is their mean"
    )
    parser.add_argument("--replot", default=None, help="only redraw the PNG of this JSON")
    parser.add_argument("--out", default="benchmarks/results", help="JSON and PNG go here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.replot:
        record = json.loads(pathlib.Path(args.replot).read_text())
        saved = argparse.Namespace(**{"seeds": 1, "data": "corpus"} | record["args"])
        plot(pathlib.Path(args.replot).with_suffix(".png"), record["runs"], saved)
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np

    import zeroshard as zs

    params, loss_fn, inner, batch_at = demo_run(args.data, args.steps)
    loss = loss_fn if args.stage < 3 else lambda p, b: loss_fn(zs.gather(p), b)
    mesh = jax.make_mesh((args.devices,), ("data",))
    size = sum(x.size for x in jax.tree.leaves(params))
    print(f"{size:,}-parameter LM, stage {args.stage}, {args.devices} devices, {args.steps} steps")
    results = {}
    for name, options in (RUNS | FLOOR | (ALONE if args.alone else {})).items():
        tx = zs.sharded(inner, quantize_block=args.block, **options)
        step = zs.make_train_step(loss, tx, mesh, stage=args.stage)
        curves, start = [], time.perf_counter()
        for seed in range(args.seeds):  # seed s: the batches of steps s * 10^6 onwards
            state = zs.init_train_state(
                params, tx, mesh, stage=args.stage, param_dtype=jnp.bfloat16
            )
            curves.append([])
            for i in range(args.steps):
                state, metrics = step(state, batch_at(seed * 10**6 + i))
                curves[-1].append(float(metrics["loss"]))
        seconds = (time.perf_counter() - start) / args.seeds
        # The lowered program's collectives: their dtypes exact (the CPU's compiled HLO
        # prints bf16 collectives as f32).
        found = zs.lowered_collectives(step.lower(state, batch_at(0)).as_text())
        finals = [float(np.mean(c[-args.tail :])) for c in curves]
        results[name] = {
            "options": {k: str(v) for k, v in options.items()},
            "losses": np.mean(curves, axis=0).tolist(),
            "final_loss": float(np.mean(finals)),
            "final_per_seed": finals,
            "ring_bytes": sum(c.ring_bytes for c in found),
            "payloads": sorted({f"{c.kind} {c.dtype}" for c in found}),
            "seconds": seconds,
        }
        print(f"{name}: final loss {np.mean(finals):.4f} per seed {finals} ({seconds:.0f} s/run)")
    exact = results["exact"]
    for r in results.values():
        r["final_vs_exact"] = r["final_loss"] / exact["final_loss"] - 1
        r["ring_vs_exact"] = r["ring_bytes"] / exact["ring_bytes"]
    print("\n| run | final loss | vs exact | per seed vs exact | ring bytes | ring vs exact |")
    print("|---|---:|---:|---|---:|---:|")
    for name, r in results.items():
        seeds = zip(r["final_per_seed"], exact["final_per_seed"], strict=True)
        each = ", ".join(f"{100 * (a / b - 1):+.2f}%" for a, b in seeds)
        print(
            f"| {name} | {r['final_loss']:.4f} | {100 * r['final_vs_exact']:+.2f}% | {each} | "
            f"{r['ring_bytes']:,.0f} | {r['ring_vs_exact']:.3f} |"
        )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ("_markov" if args.data == "markov" else "") + ("_alone" if args.alone else "")
    stem = out / f"quantized_stage{args.stage}{suffix}"
    machine = f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.machine()})"
    record = {"args": vars(args), "machine": machine, "jax": jax.__version__, "params": size}
    stem.with_suffix(".json").write_text(json.dumps(record | {"runs": results}, indent=1))
    plot(stem.with_suffix(".png"), results, args)
    print(f"Wrote {stem}.json and {stem}.png")


def demo_run(data: str, steps: int) -> tuple:
    """The demo's model and optimizer for ``steps`` steps, and its batches of ``data``:
    ``(params, loss_fn, inner, batch_at)``."""
    import optax

    from zeroshard import demo

    model_args = demo.parse_args([])
    _, vocab, tokens = demo.corpus()
    batch_at = demo.batches(tokens, model_args.batch, model_args.context)
    if data == "markov":
        batch_at = markov_batches(len(vocab), model_args.batch, model_args.context)
    _, params, loss_fn = demo.transformer(model_args, len(vocab))
    schedule = optax.cosine_decay_schedule(model_args.lr, steps, 0.1)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    return params, loss_fn, inner, batch_at


def markov_batches(vocab: int, batch: int, context: int):
    """``batch_at(step)``: sequences of an order-1 Markov chain over ``vocab`` symbols
    (each symbol's next-symbol distribution a sparse Dirichlet(0.1) draw, fixed),
    drawn afresh for every step."""
    import numpy as np

    cumulative = np.cumsum(np.random.default_rng(1234).dirichlet([0.1] * vocab, vocab), -1)

    def batch_at(step: int) -> dict:
        rng = np.random.default_rng(step)
        ids = np.zeros((batch, context + 1), np.int32)
        ids[:, 0] = rng.integers(0, vocab, batch)
        for t in range(1, context + 1):
            below = cumulative[ids[:, t - 1]] < rng.random((batch, 1))
            ids[:, t] = np.minimum(below.sum(axis=1), vocab - 1)
        return {"tokens": ids}

    return batch_at


def plot(path: pathlib.Path, results: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        label = f"{name} (final {r['final_loss']:.3f}, {100 * r['final_vs_exact']:+.2f}%)"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, lw=1)
    ax.set(
        xlabel="step",
        ylabel="loss",
        yscale="log",
        title=f"demo LM on {DATA[args.data]}, stage {args.stage}, {args.devices} devices"
        + (f", mean of {args.seeds} data orders" if args.seeds > 1 else ""),
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
