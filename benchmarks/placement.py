"""Where whole-tensor optimizers put their state: the most loaded device against plain/N.

For each optimizer and model, at N devices, from the plan alone (shapes; nothing is
allocated or run): the optimizer state and master bytes every device allocates (owned
rows are padded to the most loaded device's), over plain optax's state bytes / N, and
the update imbalance (the most loaded device's whole-tensor work over the mean). Models,
sized past every optimizer's thresholds (Adafactor factors matrices with both
dimensions >= 128):

- ``stacked``: a scan-over-layers transformer body, blocks stacked on a layer axis
  (L, d, 4d) and (L, 4d, d) with (L, d) norms, plus a (V, d) embedding;
  ``stacked=["blocks"]``; Muon gets ``MuonDimensionNumbers(1, 2)`` on the stacks (each
  layer its own matrix) and Adam on the embedding;
- ``embed``: an unscanned model whose (V, d) embedding is ~45% of the parameters
  (57% at the defaults, d = 1024 and V = 32768; 45% with ``--vocab 20480``);
- ``mlp``: an unscanned MLP with a 256 x 512 and a 512 x 256 matrix (both factored by
  Adafactor) and a bias.

Run it on two checkouts to compare (the plan's API is the same)::

    .venv/bin/python benchmarks/placement.py
    PYTHONPATH=/path/to/older/checkout .venv/bin/python benchmarks/placement.py
"""

from __future__ import annotations

import argparse
import os


def models(d: int, layers: int, vocab: int):
    """``{name: (params as ShapeDtypeStructs, stacked)}``."""
    import jax
    import jax.numpy as jnp

    f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    stacked = {
        "embed": f(vocab, d),
        "blocks": {"up": f(layers, d, 4 * d), "down": f(layers, 4 * d, d), "ln": f(layers, d)},
    }
    embed = {"embed": f(vocab, d), "head": f(d, 256)}
    embed |= {f"mlp{k}": {"up": f(d, 4 * d), "down": f(4 * d, d), "b": f(4 * d)} for k in range(3)}
    mlp = {"up": f(256, 512), "down": f(512, 256), "b": f(512)}
    return {"stacked": (stacked, ["blocks"]), "embed": (embed, None), "mlp": (mlp, None)}


def optimizers():
    """``{name: fn(params) -> optax transformation}``."""
    import jax
    import optax
    from optax.contrib import MuonDimensionNumbers, muon

    def layered_muon(params):
        layer = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
        dims = jax.tree.map(lambda x: layer if x.ndim == 3 else None, params)
        return muon(1e-2, muon_weight_dimension_numbers=dims)

    return {
        "muon (stacks per layer)": layered_muon,
        "muon (default: every 2-D leaf)": lambda p: muon(1e-2),
        "adafactor": lambda p: optax.adafactor(1e-2),
        "lamb": lambda p: optax.lamb(1e-3),
        "lars": lambda p: optax.lars(1.0),
    }


CASES = [  # (optimizer, model)
    ("muon (stacks per layer)", "stacked"),
    ("adafactor", "stacked"),
    ("lamb", "embed"),
    ("lars", "embed"),
    ("muon (default: every 2-D leaf)", "embed"),
    ("adafactor", "mlp"),
]


def row(name, model, params, stacked, n):
    """One table row: the placement's bytes and work over plain optax's / N."""
    import jax

    import zeroshard as zs

    inner = optimizers()[name](params)
    tx = zs.sharded(inner, stacked=stacked)
    try:  # a zs.sharded(...) plans with its own options (stacked layers)
        est = zs.estimate_memory(params, n, param_dtype="float32", optimizer=tx)
    except Exception:  # older versions take the inner optimizer (stacking moved nothing)
        est = zs.estimate_memory(params, n, param_dtype="float32", optimizer=inner)
    plain = zs.state_bytes_per_device(jax.eval_shape(inner.init, params))
    kinds = [s.placement for s in tx.plan(params, n).layout.slots]
    placed = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
    held = est.optimizer_state + est.master
    return (
        f"| {name} | {model} | {placed} | {held:,.0f} | {plain / n:,.0f} | "
        f"{held / (plain / n):.2f} | {est.update_imbalance:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    built = models(args.d, args.layers, args.vocab)
    print(f"N = {args.devices}, d = {args.d}, {args.layers} layers, vocab {args.vocab}\n")
    print("| optimizer | model | leaves | B/device | plain/N B | ratio | update max/mean |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, model in CASES:
        params, stacked = built[model]
        print(row(name, model, params, stacked, args.devices))


if __name__ == "__main__":
    main()
