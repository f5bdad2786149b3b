"""Step time and per-device state: replicated data parallel vs zeroshard stage 1.

Both variants train the same MLP on the same batches, interleaved step by step after
a warm-up, and the table reports medians. Example:

    .venv/bin/python benchmarks/step_time.py --devices 8 --hidden 1024 --steps 30
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from baseline import replicated_step
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    n, h = args.devices, args.hidden
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    rng = np.random.default_rng(0)
    params = {
        f"layer{i}": {
            "w": jnp.asarray(rng.normal(size=(h, h)) / np.sqrt(h), jnp.float32),
            "b": jnp.zeros(h),
        }
        for i in range(args.layers)
    }

    def loss_fn(p, batch):
        x = batch["x"]
        for i in range(args.layers):
            x = jnp.tanh(x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
        return jnp.mean((x - batch["y"]) ** 2)

    batch = {
        "x": jnp.asarray(rng.normal(size=(args.batch, h)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(args.batch, h)), jnp.float32),
    }
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    inner = optax.adam(1e-4)

    # (a) Replicated data parallel: plain optax, gradients all-reduced with pmean.
    dp_step = replicated_step(loss_fn, inner, mesh)
    replicated = NamedSharding(mesh, P())
    dp_state = jax.jit(
        lambda p: (jax.tree.map(jnp.copy, p), inner.init(p)), out_shardings=replicated
    )(params)

    # (c) zeroshard stage 1.
    tx = zs.sharded(inner, axis_name="data")
    zs_state = zs.init_train_state(params, tx, mesh)
    zs_step = zs.make_train_step(loss_fn, tx, mesh)

    dp_hlo = dp_step.lower(*dp_state, batch).compile().as_text()
    zs_hlo = zs_step.lower(zs_state, batch).compile().as_text()
    times: dict[str, list[float]] = {"replicated optax": [], "zeroshard stage 1": []}
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        dp_state = jax.block_until_ready(dp_step(*dp_state, batch))
        t1 = time.perf_counter()
        zs_state, _ = jax.block_until_ready(zs_step(zs_state, batch))
        t2 = time.perf_counter()
        if i >= args.warmup:
            times["replicated optax"].append(t1 - t0)
            times["zeroshard stage 1"].append(t2 - t1)

    size = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"\n{size:,} fp32 parameters, Adam, {n} devices ({jax.devices()[0].device_kind}), "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"jax {jax.__version__}; medians of {args.steps} interleaved steps\n"
    )
    print("| variant | optimizer state B/device | collectives (ring B/device) | step ms |")
    print("|---|---:|---:|---:|")
    rows = {
        "replicated optax": (dp_state[1], dp_hlo),
        "zeroshard stage 1": (zs_state.opt_state, zs_hlo),
    }
    for name, (state, hlo) in rows.items():
        kinds = zs.summarize(zs.compiled_collectives(hlo, n))
        wire = ", ".join(f"{k} x{v['count']}" for k, v in sorted(kinds.items()))
        ring = sum(v["ring_bytes"] for v in kinds.values())
        ms = 1e3 * statistics.median(times[name])
        print(
            f"| {name} | {zs.state_bytes_per_device(state):,} | {wire} ({ring:,.0f}) | {ms:.2f} |"
        )


if __name__ == "__main__":
    main()
