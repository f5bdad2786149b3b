"""Would error feedback help quantized gradients? A simulation, not a zeroshard feature.

Error feedback (as LoCo, arXiv 2407.04480, for 4-bit gradients) keeps on each device
the error its quantization made and adds it to its next gradient. zeroshard does not
build it: the residual is a full-size gradient per device. This script measures what
it would buy, on one device: the demo's language model (bf16 parameters, fp32 master,
AdamW with global-norm clipping, as ``benchmarks/quantized.py``) trained with the mean
of ``--devices`` simulated devices' gradients (the global batch split as zeroshard's
step splits it), each cut into zeroshard's pieces and sent through
:class:`zeroshard.communication.quantized.Quantizer` codes exactly as the quantized reduce-scatter
does, with and without each device's residual added back. Prints the final losses
(the mean of the last ``--tail`` steps) against the exact mean's, writes JSON.

    .venv/bin/python benchmarks/error_feedback.py --steps 300 --bits 4
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated devices")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bits", type=int, choices=[4, 8], default=4)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--tail", type=int, default=20)
    parser.add_argument("--data", choices=["corpus", "markov"], default="corpus")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results", help="JSON goes here")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from quantized import demo_run

    from zeroshard.communication.quantized import Quantizer

    n, q = args.devices, Quantizer(args.bits, args.block)
    params, loss_fn, inner, batch_at = demo_run(args.data, args.steps)

    def sent(g):  # (devices, *leaf) -> each device's pieces after their trip as codes
        flat = g.reshape(n, -1).astype(jnp.float32)
        width = -(-flat.shape[1] // n)
        rows = jnp.pad(flat, ((0, 0), (0, n * width - flat.shape[1]))).reshape(n * n, width)
        (back,) = q.decode(*q.encode([rows]), [width], jnp.float32)
        return back.reshape(n, n * width)[:, : flat.shape[1]].reshape(g.shape)

    @jax.jit
    def step(master, opt_state, residual, batch, feedback):
        compute = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        parts = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0))(compute, parts)
        grads = jax.tree.map(lambda g, r: g.astype(jnp.float32) + r * feedback, grads, residual)
        trips = jax.tree.map(sent, grads)
        residual = jax.tree.map(lambda g, t: g - t, grads, trips)
        mean = jax.tree.map(lambda t: t.mean(0), trips)
        updates, opt_state = inner.update(mean, opt_state, master)
        return optax.apply_updates(master, updates), opt_state, residual, loss.mean()

    exact_step = jax.jit(
        lambda master, opt_state, batch: _exact(loss_fn, inner, n, master, opt_state, batch)
    )
    results = {}
    for name in ("exact", f"int{args.bits}", f"int{args.bits} + error feedback"):
        finals = []
        for seed in range(args.seeds):
            master, opt_state = params, inner.init(params)
            residual = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), jnp.float32), params)
            losses = []
            for i in range(args.steps):
                batch = batch_at(seed * 10**6 + i)
                if name == "exact":
                    master, opt_state, loss = exact_step(master, opt_state, batch)
                else:
                    feedback = jnp.float32("feedback" in name)
                    master, opt_state, residual, loss = step(
                        master, opt_state, residual, batch, feedback
                    )
                losses.append(float(loss))
            finals.append(float(np.mean(losses[-args.tail :])))
        results[name] = {"final_per_seed": finals, "final_loss": float(np.mean(finals))}
    exact = results["exact"]["final_loss"]
    print(f"\n{args.data}, int{args.bits}, {n} simulated devices, {args.steps} steps")
    print("| run | final loss | vs exact | per seed |")
    print("|---|---:|---:|---|")
    for name, r in results.items():
        seeds = ", ".join(f"{x:.4f}" for x in r["final_per_seed"])
        change = 100 * (r["final_loss"] / exact - 1)
        print(f"| {name} | {r['final_loss']:.4f} | {change:+.2f}% | {seeds} |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"error_feedback_{args.data}_int{args.bits}.json"
    path.write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))


def _exact(loss_fn, inner, n, master, opt_state, batch):
    """The same step with the exact mean of the simulated devices' gradients."""
    import jax
    import jax.numpy as jnp
    import optax

    compute = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
    parts = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
    loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0))(compute, parts)
    mean = jax.tree.map(lambda g: g.astype(jnp.float32).mean(0), grads)
    updates, opt_state = inner.update(mean, opt_state, master)
    return optax.apply_updates(master, updates), opt_state, loss.mean()


if __name__ == "__main__":
    main()
