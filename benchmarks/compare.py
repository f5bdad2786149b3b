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

``--optimizer muon`` runs ``optax.contrib.muon`` instead of Adam: replicated data
parallelism orthogonalises every matrix on every device; zeroshard places each matrix
whole on one device (owned), which orthogonalises only its own.

Per variant: optimizer-state + master bytes per device (live arrays), XLA's argument,
temp, output and alias bytes, the collectives of the compiled step with their
ring-normalised bytes, and the median step time (variants interleaved step by step,
after a warm-up). Prints markdown tables, writes JSON and a PNG.

    .venv/bin/python benchmarks/compare.py --devices 1 2 4 8 --widths 256 512 1024
    .venv/bin/python benchmarks/compare.py --optimizer muon --layers 8 --widths 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--pack-bytes", type=int, default=None, help="zs.sharded's pack_bytes (default: its own)"
    )
    parser.add_argument("--optimizer", choices=["adam", "muon"], default="adam")
    parser.add_argument("--out", default="benchmarks/results", help="JSON and PNG go here")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", max(args.devices))
    import jax.numpy as jnp
    import numpy as np
    import optax
    from baseline import replicated_step
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    inner = optax.adam(1e-4) if args.optimizer == "adam" else optax.contrib.muon(1e-4)
    suffix = "" if args.optimizer == "adam" else f"-{args.optimizer}"
    machine = (
        f"{jax.devices()[0].device_kind} x{jax.device_count()} "
        f"({platform.machine()}, {os.cpu_count()} CPUs), jax {jax.__version__}"
    )

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

    def variants(params, mesh, batch):
        """name -> (run(state) -> state, lower(state) -> Lowered, state, opt(state))."""
        n = mesh.shape["data"]
        replicated = NamedSharding(mesh, P())
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=replicated)
        loss_fn = make_loss(1)
        out = {}

        dp = replicated_step(loss_fn, inner, mesh)
        out["replicated"] = (
            lambda s: dp(*s, batch),
            lambda s: dp.lower(*s, batch),
            (copy(params), copy(inner.init(params))),
            lambda s: s[1],
        )

        # Plain muon under jit with a sharded state fails on Explicit mesh axes (its
        # Newton-Schulz matmul "produces an illegally sharded result"): left out.
        if args.optimizer == "adam":

            def spread(x):
                k = next((i for i, d in enumerate(x.shape) if d % n == 0 and d > 0), None)
                return NamedSharding(mesh, P() if k is None else P(*(None,) * k, "data"))

            opt_shardings = jax.tree.map(spread, jax.eval_shape(inner.init, params))

            def jit_step(p, s, b):
                updates, s = inner.update(jax.grad(loss_fn)(p, b), s, p)
                return optax.apply_updates(p, updates), s

            js = jax.jit(
                jit_step,
                in_shardings=(replicated, opt_shardings, NamedSharding(mesh, P("data"))),
                out_shardings=(replicated, opt_shardings),
                donate_argnums=(0, 1),
            )
            opt = jax.jit(inner.init, out_shardings=opt_shardings)(params)
            out["jit-sharded"] = (
                lambda s: js(*s, batch),
                lambda s: js.lower(*s, batch),
                (copy(params), opt),
                lambda s: s[1],
            )
        pack = {} if args.pack_bytes is None else {"pack_bytes": args.pack_bytes}
        dropin = zs.sharded(inner, axis_name="data", mesh=mesh, **pack)

        def dropin_step(p, s, b):  # the user's own jit step; only the optimizer differs
            updates, s = dropin.update(jax.grad(loss_fn)(p, b), s, p)
            return optax.apply_updates(p, updates), s

        ds = jax.jit(dropin_step, donate_argnums=(0, 1))
        out["zeroshard-jit"] = (
            lambda s: ds(*s, batch),
            lambda s: ds.lower(*s, batch),
            (copy(params), dropin.init(copy(params))),
            lambda s: (s[1].inner_state, s[1].master, s[1].owned),
        )
        tx = zs.sharded(inner, axis_name="data", **pack)
        for stage in (1, 2, 3):
            step = zs.make_train_step(make_loss(stage), tx, mesh, stage=stage)
            out[f"zeroshard-{stage}"] = (
                lambda s, step=step: step(s, batch)[0],
                lambda s, step=step: step.lower(s, batch),
                zs.init_train_state(params, tx, mesh, stage=stage),
                lambda s: (s.opt_state.inner_state, s.opt_state.master, s.opt_state.owned),
            )
        return out

    results = []
    for width in args.widths:
        rng = np.random.default_rng(0)
        params = {
            "layers": [
                {
                    "w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),
                    "b": jnp.zeros(width),
                }
                for _ in range(args.layers)
            ]
        }
        size = sum(x.size for x in jax.tree.leaves(params))
        for n in args.devices:
            mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
            batch = {
                "x": jnp.asarray(rng.normal(size=(args.batch, width)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(args.batch, width)), jnp.float32),
            }
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
            fns = variants(params, mesh, batch)
            states = {name: v[2] for name, v in fns.items()}
            rows = {}
            for name, (_, lower, state, opt_of) in fns.items():
                compiled = lower(state).compile()
                stats = compiled.memory_analysis()
                kinds = zs.summarize(zs.collectives(compiled.as_text(), n))
                rows[name] = {
                    "width": width,
                    "params": size,
                    "devices": n,
                    "variant": name,
                    "opt_state_bytes": zs.state_bytes_per_device(opt_of(state)),
                    "argument_bytes": stats.argument_size_in_bytes,
                    "temp_bytes": stats.temp_size_in_bytes,
                    "output_bytes": stats.output_size_in_bytes,
                    "alias_bytes": stats.alias_size_in_bytes,
                    "collectives": {k: v["count"] for k, v in kinds.items()},
                    "ring_bytes": sum(v["ring_bytes"] for v in kinds.values()),
                    "times": [],
                }
            for i in range(args.warmup + args.steps):
                for name, (fn, *_) in fns.items():
                    t0 = time.perf_counter()
                    states[name] = jax.block_until_ready(fn(states[name]))
                    if i >= args.warmup:
                        rows[name]["times"].append(time.perf_counter() - t0)
            for row in rows.values():
                row["step_ms"] = 1e3 * statistics.median(row.pop("times"))
                results.append(row)
            print_table(width, size, n, rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"compare{suffix}.json"), "w") as f:
        json.dump(
            {
                "machine": machine,
                "optimizer": args.optimizer,
                "steps": args.steps,
                "results": results,
            },
            f,
            indent=1,
        )
    plot(results, os.path.join(args.out, f"memory_vs_devices{suffix}.png"))
    print(
        f"\n{machine}, {args.optimizer}; medians of {args.steps} interleaved steps. "
        f"Wrote {args.out}/compare{suffix}.json and memory_vs_devices{suffix}.png"
    )


def print_table(width, size, n, rows):
    a, b = rows["replicated"], rows.get("jit-sharded", rows["replicated"])
    print(f"\n### width {width} ({size:,} params), {n} devices\n")
    print(
        "| variant | opt+master B | arg B | temp B | collectives | ring B | step ms "
        "| state vs (a) | ring vs (a) | ring vs (b) | time vs (a) | time vs (b) |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    ratio = lambda x, y: f"{x / y:.3f}" if y else "-"
    for name, r in rows.items():
        kinds = ", ".join(f"{k} x{c}" for k, c in sorted(r["collectives"].items())) or "none"
        print(
            f"| {name} | {r['opt_state_bytes']:,} | {r['argument_bytes']:,} | "
            f"{r['temp_bytes']:,} | {kinds} | {r['ring_bytes']:,.0f} | {r['step_ms']:.2f} | "
            f"{ratio(r['opt_state_bytes'], a['opt_state_bytes'])} | "
            f"{ratio(r['ring_bytes'], a['ring_bytes'])} | "
            f"{ratio(r['ring_bytes'], b['ring_bytes'])} | "
            f"{ratio(r['step_ms'], a['step_ms'])} | {ratio(r['step_ms'], b['step_ms'])} |"
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
