"""Quantized collectives: the loss curves and wire bytes of exact, int8 and int4 runs.

Trains the demo's language model (``zeroshard.demo``: a character-level transformer on
the packaged text, bf16 parameters with fp32 masters, AdamW with global-norm clipping
and a cosine schedule) on N simulated devices three times from the same start on the
same batches: exact collectives, int8 gradients + int8 weights, int4 gradients + int8
weights (``zs.sharded(..., quantize_grads=, quantize_weights=)``). Per run: the loss
of every step, the final loss (the mean of the last ``--tail`` steps, the same batches
in every run), its difference from the exact run's, and the ring bytes of the
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=1)
    parser.add_argument("--tail", type=int, default=20, help="steps the final loss averages")
    parser.add_argument("--block", type=int, default=256, help="quantize_block")
    parser.add_argument("--out", default="benchmarks/results", help="JSON and PNG go here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zeroshard as zs
    from zeroshard import demo

    model_args = demo.parse_args([])
    _, vocab, tokens = demo.corpus()
    batch_at = demo.batches(tokens, model_args.batch, model_args.context)
    _, params, loss_fn = demo.transformer(model_args, len(vocab))
    loss = loss_fn if args.stage < 3 else lambda p, b: loss_fn(zs.gather(p), b)
    schedule = optax.cosine_decay_schedule(model_args.lr, args.steps, 0.1)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    mesh = jax.make_mesh((args.devices,), ("data",))
    size = sum(x.size for x in jax.tree.leaves(params))
    print(f"{size:,}-parameter LM, stage {args.stage}, {args.devices} devices, {args.steps} steps")
    results = {}
    for name, options in RUNS.items():
        tx = zs.sharded(inner, quantize_block=args.block, **options)
        state = zs.init_train_state(params, tx, mesh, stage=args.stage, param_dtype=jnp.bfloat16)
        step = zs.make_train_step(loss, tx, mesh, stage=args.stage)
        # The lowered program's collectives: their dtypes exact (the CPU's compiled HLO
        # prints bf16 collectives as f32).
        found = zs.lowered_collectives(step.lower(state, batch_at(0)).as_text())
        losses, start = [], time.perf_counter()
        for i in range(args.steps):
            state, metrics = step(state, batch_at(i))
            losses.append(float(metrics["loss"]))
        seconds = time.perf_counter() - start
        final = float(np.mean(losses[-args.tail :]))
        results[name] = {
            "options": options,
            "losses": losses,
            "final_loss": final,
            "ring_bytes": sum(c.ring_bytes for c in found),
            "payloads": sorted({f"{c.kind} {c.dtype}" for c in found}),
            "seconds": seconds,
        }
        print(f"{name}: final loss {final:.4f} ({seconds:.0f} s)")
    exact = results["exact"]
    for r in results.values():
        r["final_vs_exact"] = r["final_loss"] / exact["final_loss"] - 1
        r["ring_vs_exact"] = r["ring_bytes"] / exact["ring_bytes"]
    print("\n| run | final loss | vs exact | ring bytes | ring vs exact |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['final_loss']:.4f} | {100 * r['final_vs_exact']:+.2f}% | "
            f"{r['ring_bytes']:,.0f} | {r['ring_vs_exact']:.3f} |"
        )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"quantized_stage{args.stage}"
    machine = f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.machine()})"
    record = {"args": vars(args), "machine": machine, "jax": jax.__version__, "params": size}
    stem.with_suffix(".json").write_text(json.dumps(record | {"runs": results}, indent=1))
    plot(stem.with_suffix(".png"), results, args)
    print(f"Wrote {stem}.json and {stem}.png")


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
        title=f"demo LM, stage {args.stage}, {args.devices} devices: quantized collectives",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
