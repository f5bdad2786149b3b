"""Checkpoint save/restore time and on-disk size, saved on N devices, restored on M,
with checksums recorded and verified and without (interleaved in each repeat).

.venv/bin/python benchmarks/checkpoint_io.py --hidden 1024 --layers 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(args.devices))
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zeroshard as zs

    h, rng = args.hidden, np.random.default_rng(0)
    params = {
        f"layer{i}": {"w": jnp.asarray(rng.normal(size=(h, h)), jnp.float32), "b": jnp.zeros(h)}
        for i in range(args.layers)
    }
    size = sum(x.size for x in jax.tree.leaves(params))
    tx = zs.sharded(optax.adamw(1e-3), axis_name="data")
    print(
        f"\n{size:,} parameters, bf16 compute, fp32 master, AdamW; "
        f"medians of {args.repeats}; jax {jax.__version__}, {os.cpu_count()} CPUs\n"
    )
    print(
        "| saved on | checksums | save returns (ms) | save finalised (ms) | on disk (MB) "
        "| restore on | restore (ms) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    overheads = []
    med = lambda xs: 1e3 * statistics.median(xs)
    for n in args.devices:
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
        # One step, so the moments hold real (incompressible) values.
        loss_fn = lambda p, x: sum(jnp.mean((x @ p[k]["w"] + p[k]["b"]) ** 2) for k in p)
        x = jnp.asarray(rng.normal(size=(8, h)), jnp.float32)
        state, _ = zs.make_train_step(loss_fn, tx, mesh)(state, x)
        # The checksums alone, on the logical state as save computes them.
        item = dict(zip(("params", "opt_state"), zs.to_optax_state(state, tx), strict=True))
        item["step"] = state.step
        hashing = []
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            zs.checksums(jax.block_until_ready(item))
            if r:
                hashing.append(time.perf_counter() - t0)
        variants = (False, True)
        returns = {v: [] for v in variants}
        finalised = {v: [] for v in variants}
        restores = {(v, m): [] for v in variants for m in args.devices}
        disk = {}
        for r in range(args.repeats + 1):  # the first round warms up (compilation)
            for checks in variants if r % 2 else variants[::-1]:  # alternate the order
                with tempfile.TemporaryDirectory() as directory:
                    ckpt = zs.CheckpointManager(directory, tx, checksums=checks)
                    t0 = time.perf_counter()
                    ckpt.save(state)
                    t1 = time.perf_counter()
                    ckpt.wait_until_finished()
                    t2 = time.perf_counter()
                    disk[checks] = sum(
                        os.path.getsize(os.path.join(root, f))
                        for root, _, files in os.walk(directory)
                        for f in files
                    )
                    for m in args.devices:
                        target = jax.make_mesh((m,), ("data",), devices=jax.devices()[:m])
                        t3 = time.perf_counter()
                        jax.block_until_ready(ckpt.restore(target, like=state.params))
                        if r:
                            restores[checks, m].append(time.perf_counter() - t3)
                    ckpt.close()
                if r:
                    returns[checks].append(t1 - t0)
                    finalised[checks].append(t2 - t0)
        for checks in variants:
            for m in args.devices:
                print(
                    f"| {n} | {'yes' if checks else 'no'} | {med(returns[checks]):.0f} "
                    f"| {med(finalised[checks]):.0f} | {disk[checks] / 1e6:.1f} | {m} "
                    f"| {med(restores[checks, m]):.0f} |"
                )
        ratio = lambda d: statistics.median(d[True]) / statistics.median(d[False]) - 1
        overheads.append(
            f"saved on {n}: checksums alone {med(hashing):.0f} ms; save returns "
            f"{ratio(returns):+.1%}, finalised {ratio(finalised):+.1%}"
            + "".join(
                f", restore on {m} {med(restores[True, m]) / med(restores[False, m]) - 1:+.1%}"
                for m in args.devices
            )
        )
    print("\nChecksum overhead (medians, with vs without):")
    for line in overheads:
        print(f"- {line}")


if __name__ == "__main__":
    main()
