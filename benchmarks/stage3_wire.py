"""Stage 3 with owned leaves: bytes on the wire per step, Muon against AdamW.

On ``compare.py``'s scan-stacked transformer (``--model stacked``), zeroshard's own
stage-3 step with ``optax.contrib.muon`` (the block stacks layer-owned) and with
``optax.adamw`` (every leaf sliced), fp32 parameters and bf16 parameters with an fp32
master: the collectives of one step (those inside the layer scan counted once per
layer) and their ring-normalised bytes.

    .venv/bin/python benchmarks/stage3_wire.py --layers 8 --width 256
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from compare import stacked_model, step_collectives

    import zeroshard as zs

    model = stacked_model(args, args.width, np.random.default_rng(0))
    mesh = jax.make_mesh((args.devices,), ("data",))
    batch = model.batch(np.random.default_rng(1))
    inners = {
        "muon": optax.contrib.muon(1e-4, muon_weight_dimension_numbers=model.muon_dims),
        "adamw": optax.adamw(1e-4),
    }
    print("| params | optimizer | collectives | ring B | vs AdamW |\n|---|---|---|---:|---:|")
    for dtype in (jnp.float32, jnp.bfloat16):
        ring = {}
        for name in ("adamw", "muon"):
            tx = zs.sharded(inners[name], stacked=model.stacked)
            state = zs.init_train_state(model.params, tx, mesh, stage=3, param_dtype=dtype)
            step = zs.make_train_step(model.make_loss(3), tx, mesh, stage=3)
            hlo = step.lower(state, batch).compile().as_text()
            kinds = zs.summarize(step_collectives(hlo, args.devices))
            ring[name] = sum(c["ring_bytes"] for c in kinds.values())
            counts = ", ".join(f"{k} x{c['count']}" for k, c in sorted(kinds.items()))
            print(
                f"| {jnp.dtype(dtype).name} | {name} | {counts} | {ring[name]:,.0f} | "
                f"{ring[name] / ring['adamw']:.3f} |"
            )


if __name__ == "__main__":
    main()
