"""The quantized collectives' own compute: encoding and decoding on one device.

On one device zeroshard sends nothing and quantizes nothing, so the quantized step's
extra cost can only be seen from its parts: per size, format and input dtype, the
median time of ``Quantizer.encode`` then ``decode`` of one ``(8, size / 8)`` buffer
(what a device sends at N = 8), against a plain ``x * 1`` of the same buffer (one
read and one write of it), both jitted. Prints a markdown table and writes JSON.

    .venv/bin/python benchmarks/codec.py --sizes 1000000 16000000
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 16_000_000])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results", help="JSON goes here")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from zeroshard.communication.quantized import Quantizer

    def timed(fn, x):
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    rows = []
    print("| size | dtype | format | encode + decode ms | copy ms | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    for size in args.sizes:
        for dtype in (jnp.float32, jnp.bfloat16):
            x = jax.random.normal(jax.random.key(0), (8, size // 8), dtype)
            copy = timed(jax.jit(lambda x: x * 1), x)
            for bits in (8, 4):
                q = Quantizer(bits, args.block)
                trip = jax.jit(lambda x, q=q: q.decode(*q.encode([x]), [x.shape[1]], x.dtype)[0])
                ms = timed(trip, x)
                name = f"int{bits}"
                rows.append(
                    {
                        "size": size,
                        "dtype": x.dtype.name,
                        "format": name,
                        "ms": ms,
                        "copy_ms": copy,
                        "device": jax.devices()[0].device_kind,
                    }
                )
                print(
                    f"| {size:,} | {x.dtype.name} | {name} | {ms:.3f} | {copy:.3f} | "
                    f"{ms / copy:.1f} |"
                )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
