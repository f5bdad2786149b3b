"""Demo: train a small MLP data-parallel on simulated CPU devices with zeroshard.

Run ``python -m zeroshard.demo`` (or ``make demo``). It fits a random teacher network
with bf16 compute, fp32 master weights, global-norm clipping and AdamW, then prints
the memory each device holds, replicated optax vs zeroshard, read from live arrays,
and the collectives of the compiled step.
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--hidden", type=int, default=256, help="MLP width")
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=100)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    if jax.device_count() != args.devices:
        raise SystemExit(
            f"JAX already started with {jax.device_count()} devices; run the demo in a fresh "
            "process."
        )
    n, d_in, d_out, h = args.devices, 32, 8, args.hidden
    rng = np.random.default_rng(0)
    init = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)
    teacher = [init(d_in, 64), init(64, d_out)]
    params = {
        "l1": {"w": init(d_in, h), "b": jnp.zeros(h)},
        "l2": {"w": init(h, h), "b": jnp.zeros(h)},
        "l3": {"w": init(h, d_out), "b": jnp.zeros(d_out)},
    }

    def make_batch(step: int) -> dict:
        x = np.random.default_rng(step).normal(size=(args.batch, d_in)).astype(np.float32)
        return {"x": x, "y": np.asarray(jnp.tanh(x @ teacher[0]) @ teacher[1])}

    def loss_fn(p: dict, batch: dict) -> jax.Array:
        x = batch["x"].astype(jnp.bfloat16)
        for name in ("l1", "l2"):
            x = jax.nn.gelu(x @ p[name]["w"] + p[name]["b"])
        out = (x @ p["l3"]["w"] + p["l3"]["b"]).astype(jnp.float32)
        return jnp.mean((out - batch["y"]) ** 2)

    mesh = jax.make_mesh((n,), ("data",))
    inner = optax.chain(
        zs.clip_by_global_norm(1.0, axis_name="data"), optax.adamw(args.lr, weight_decay=1e-4)
    )
    tx = zs.sharded(inner, axis_name="data")
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    train_step = zs.make_train_step(loss_fn, tx, mesh)
    size = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"zeroshard demo: {size:,}-parameter MLP, {n} simulated CPU devices, "
        f"global batch {args.batch}, bf16 compute, fp32 master, AdamW + global-norm clip"
    )

    hlo = train_step.lower(state, make_batch(0)).compile().as_text()
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
        state, metrics = train_step(state, make_batch(step))
        if step % args.log_every == 0 or step == args.steps - 1:
            loss = float(metrics["loss"])
            losses.append(loss)
            rate = (step + 1) / (time.perf_counter() - start)
            print(
                f"  step {step:5d}  loss {loss:.5f}  grad norm "
                f"{float(metrics['grad_norm']):.4f}  {rate:6.1f} steps/s",
                flush=True,
            )

    # Per-device bytes, from live arrays: plain optax keeps everything on every device.
    replicated = NamedSharding(mesh, P())
    master = jax.device_put(params, replicated)
    moments = jax.device_put(inner.init(params), replicated)
    rows = {
        "params (bf16, replicated)": (state.params, state.params),
        "fp32 master": (master, state.opt_state.master),
        "Adam moments": (moments, state.opt_state.inner_state),
    }
    print(f"\nPer-device memory, {n} devices:\n")
    print("| component | replicated optax | zeroshard | ratio |")
    print("|---|---:|---:|---:|")
    report = {}
    for name, (rep, ours) in rows.items():
        a, b = zs.state_bytes_per_device(rep), zs.state_bytes_per_device(ours)
        report[name] = (a, b)
        print(f"| {name} | {a:,} B | {b:,} B | {b / a:.3f} |")
    a = sum(r[0] for r in report.values())
    b = sum(r[1] for r in report.values())
    print(f"| total | {a:,} B | {b:,} B | {b / a:.3f} |")
    state_ratio = (report["fp32 master"][1] + report["Adam moments"][1]) / (
        report["fp32 master"][0] + report["Adam moments"][0]
    )
    print(
        f"\noptimizer state + master per device: {state_ratio:.4f} of replicated "
        f"(1/{n} = {1 / n:.4f}; the rest is padding and replicated scalars)"
    )
    kinds = zs.summarize(zs.collectives(hlo, n))
    print(
        "collectives per step (compiled HLO; CPU prints bf16 collectives as f32): "
        + ", ".join(f"{k} x{v['count']} ({v['bytes']:,} B)" for k, v in sorted(kinds.items()))
    )
    return {"losses": losses, "memory": report, "state_ratio": state_ratio}


if __name__ == "__main__":
    main()
