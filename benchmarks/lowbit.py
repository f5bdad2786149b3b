"""Low-bit optimizer state (``zs.sharded(..., state_bits=8 | 4)``): bytes and convergence.

Bytes: compare.py's scan-stacked transformer (``--width``, ``--layers``, vocabulary
512), Adam, on ``--devices`` simulated devices: the optimizer state on a device
(``zs.estimate_memory``, which counts what ``zs.init_train_state`` lays out: the codes
and the block scales) against float32 state.

Convergence: the demo's language model (``python -m zeroshard.demo``: 2 layers,
d_model 128, bf16 compute, fp32 master weights) and compare.py's scan-stacked
transformer (``--width``, ``--layers``) trained on the demo's text, with the demo's
optimizer (global-norm clipping 1.0, AdamW, cosine decay from 3e-3, weight decay
0.01), ``--steps`` steps of a 32 x 64-token global batch (the same batches for every
run), for each ``--seeds`` (the initial weights): float32, 8-bit and 4-bit state.
``--data markov`` trains on text drawn afresh every step instead (an order-1 Markov
chain over the text's characters, as ``benchmarks/quantized.py --data markov``), where
the loss measures learning, not memorising. Prints the final loss (mean of the last 10
steps) per run and its mean over the seeds, and plots the mean curves (``--plot``)::

    .venv/bin/python benchmarks/lowbit.py --steps 300 --seeds 0 1 2 \\
        --plot docs/images/lowbit.png

Fidelity (``--fidelity``, instead of convergence): float32 Adam trains each model
(seed 0, the same optimizer and batches); beside it, fed the same gradients at the
same weights, the same optimizer with 8-bit and 4-bit state (the one-line drop-in,
on one device) updates its own coded state. Prints, per model and bits, the coded
update's error ``|v - u| / |u|`` and its length along float32's update ``<v, u> /
<u, u>`` (above 1: longer steps), their mean over steps 20 to the last, and, at steps
10, 100 and the last, the share of the float32 state's coded elements below the
smallest point of their block's grid. Deterministic: no trajectory of its own, so no
seed noise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from types import SimpleNamespace


def parse_args() -> argparse.Namespace:
    from quantized import add_data_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--width", type=int, default=256, help="the stacked transformer's")
    parser.add_argument("--layers", type=int, default=4, help="the stacked transformer's")
    add_data_argument(parser)  # (benchmarks/quantized.py's)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--bits", type=int, nargs="+", choices=(32, 8, 4), default=[32, 8, 4])
    parser.add_argument("--plot", default="", help="a PNG of the loss curves ('' for none)")
    parser.add_argument("--fidelity", action="store_true", help="the coded updates' error")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(f"jax {jax.__version__}, {jax.device_count()} devices, data: {args.data}")
    print_bytes(args)
    if args.fidelity:
        for name in args.models:
            print_fidelity(args, name, MODELS[name][1](args, 0))
        return
    # (each run's losses are kept in a file as it ends: a later call adds to them)
    results = f"lowbit_{args.data}_{args.steps}_n{args.devices}.json"
    path = pathlib.Path(__file__).parent / "results" / results
    curves = json.loads(path.read_text()) if path.exists() else {}
    for name in args.models:
        for bits in args.bits:
            for seed in args.seeds:
                start = time.perf_counter()
                losses = train(args, MODELS[name][1](args, seed), None if bits == 32 else bits)
                curves[f"{name}|{bits}|{seed}"] = losses
                path.parent.mkdir(exist_ok=True)
                path.write_text(json.dumps(curves))
                run, took = (
                    f"{MODELS[name][0]}, {bits}-bit state, seed {seed}",
                    time.perf_counter() - start,
                )
                print(f"{run}: final loss {final_loss(losses):.4f} ({took:.0f} s)", flush=True)
    print_losses(args, curves)
    if args.plot:
        plot(args, curves)
        print(f"Wrote {args.plot}")


def print_bytes(args: argparse.Namespace) -> None:
    import numpy as np
    import optax
    from compare import stacked_model as compare_stacked

    import zeroshard as zs

    spec = SimpleNamespace(layers=args.layers, vocab=512, batch=32, seq=64)
    params = compare_stacked(spec, args.width, np.random.default_rng(0)).params
    size = sum(x.size for x in jax_leaves(params))
    print(
        f"\nAdam state per device, compare.py's stacked transformer ({size:,} parameters), "
        f"N = {args.devices}:\n"
    )
    print("| state | bytes per device | vs float32 |\n|---|---:|---:|")
    held = {}
    for bits in (None, 8, 4):
        tx = zs.sharded(optax.adam(1e-3), stacked=["blocks"], state_bits=bits)
        held[bits] = zs.estimate_memory(params, args.devices, optimizer=tx).optimizer_state
        print(f"| {bits or 32} bits | {held[bits]:,.0f} | {held[bits] / held[None]:.3f}x |")


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def demo_model(args: argparse.Namespace, seed: int) -> SimpleNamespace:
    """The demo's model, loss and batches, its weights from ``seed``."""
    from zeroshard import demo

    demo_args = demo.parse_args(["--seed", str(seed), "--steps", str(args.steps)])
    _, params, loss_fn = demo.transformer(demo_args, len(demo.corpus()[1]))
    return SimpleNamespace(params=params, loss=loss_fn, batch_at=text(args), stacked=None)


def text(args: argparse.Namespace):
    """``batch_at(step)``: 32 x 65 tokens of the demo's text, or of the Markov chain."""
    from quantized import markov_batches

    from zeroshard import demo

    _, vocab, tokens = demo.corpus()
    if args.data == "markov":
        return markov_batches(len(vocab), 32, 64)
    return demo.batches(tokens, 32, 64)


def stacked_model(args: argparse.Namespace, seed: int) -> SimpleNamespace:
    """compare.py's scan-stacked transformer on the demo's text, its weights from
    ``seed``."""
    import numpy as np
    from compare import stacked_model as compare_stacked

    from zeroshard import demo

    spec = SimpleNamespace(layers=args.layers, vocab=len(demo.corpus()[1]), batch=32, seq=64)
    model = compare_stacked(spec, args.width, np.random.default_rng(seed))
    tokens_at = text(args)

    def batch_at(step: int) -> dict:
        t = tokens_at(step)["tokens"]
        return {"tokens": t[:, :-1], "targets": t[:, 1:]}

    return SimpleNamespace(
        params=model.params, loss=model.make_loss(1), batch_at=batch_at, stacked=["blocks"]
    )


def train(args: argparse.Namespace, model: SimpleNamespace, bits: int | None) -> list[float]:
    """The losses of ``args.steps`` steps of ``model`` with ``bits``-bit state."""
    import jax
    import jax.numpy as jnp

    import zeroshard as zs

    tx = zs.sharded(optimizer(args.steps), stacked=model.stacked, state_bits=bits)
    mesh = jax.make_mesh((args.devices,), ("data",))
    dtype = jnp.bfloat16 if model.stacked is None else None  # (the demo's bf16 compute)
    state = zs.init_train_state(model.params, tx, mesh, param_dtype=dtype)
    step = zs.make_train_step(model.loss, tx, mesh)
    losses = []
    for i in range(args.steps):
        state, metrics = step(state, model.batch_at(i))
        losses.append(float(metrics["loss"]))
    return losses


def optimizer(steps: int):
    """The demo's: global-norm clipping, AdamW, cosine decay from 3e-3."""
    import optax

    schedule = optax.cosine_decay_schedule(3e-3, steps, 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def print_fidelity(args: argparse.Namespace, name: str, model: SimpleNamespace) -> None:
    """The fidelity of ``model``'s coded updates (the module's ``--fidelity``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zeroshard as zs

    inner = optimizer(args.steps)
    coded = {bits: zs.sharded(inner, stacked=model.stacked, state_bits=bits) for bits in (8, 4)}
    flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])

    @jax.jit
    def step(params, states, batch):
        grads = jax.grad(model.loss)(params, batch)
        u, new = inner.update(grads, states[32], params)
        new, stats = {32: new}, {}
        for bits, tx in coded.items():
            v, new[bits] = tx.update(grads, states[bits], params)
            du, dv = flat(u), flat(v)
            error = jnp.linalg.norm(dv - du) / jnp.linalg.norm(du)
            stats[bits] = jnp.stack([error, jnp.vdot(dv, du) / jnp.vdot(du, du)])
        return optax.apply_updates(params, u), new, stats

    rows, below = {8: [], 4: []}, []
    # (on one device: the codes are the same on every device count, and on 8 simulated
    # CPU devices two drop-in optimizers in one jit deadlocked in XLA's collectives)
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        params = model.params
        states = {32: inner.init(params)} | {b: tx.init(params) for b, tx in coded.items()}
        for i in range(args.steps):
            params, states, stats = step(params, states, model.batch_at(i))
            for bits in rows:
                rows[bits].append(np.asarray(stats[bits]))
            if i + 1 in (10, 100, args.steps):
                below.append((i + 1, below_grid(states[32])))
    print(f"\n{MODELS[name][0]}: coded updates against float32's, mean of steps 20-{args.steps}")
    print("| state | update error | length along float32's |\n|---|---:|---:|")
    for bits, r in rows.items():
        error, length = np.mean(r[19:], axis=0)
        print(f"| {bits} bits | {error:.2%} | {length:.4f} |")
    print("\nShare of the float32 state's coded elements below their grid's smallest point:")
    for i, shares in below:
        print(f"  step {i}: " + ", ".join(f"{k} {v:.2e}" for k, v in shares.items()))


def below_grid(state) -> dict[str, float]:
    """The share of Adam's ``mu`` (magnitudes) and ``nu`` (square roots) elements,
    of leaves coded at 8 and 4 bits, below the smallest point of their block's grid
    (blocks of the raveled leaf, of each layer where it is 3-D: stacked layers)."""
    import jax
    import numpy as np
    import optax

    from zeroshard.core.lowbit import LowBit

    shares = {}
    for moment in ("mu", "nu"):
        (tree,) = optax.tree_utils.tree_get_all_with_path(state, moment)
        for bits in (8, 4):
            store = LowBit(bits)
            grid = store.unsigned if moment == "nu" else store.signed
            smallest = float(grid.decode(np.array(1)))  # (the grid's smallest point)
            below, held = 0, 0
            for x in jax.tree.leaves(tree[1]):
                per_layer = x[0].size if x.ndim == 3 else x.size
                if x.ndim not in (2, 3) or per_layer < store.block:
                    continue
                x = np.abs(np.asarray(x, np.float64)).reshape(len(x) if x.ndim == 3 else 1, -1)
                x = np.pad(x, ((0, 0), (0, -x.shape[1] % store.block))).reshape(-1, store.block)
                x = np.sqrt(x) if moment == "nu" else x
                ratio = x / np.maximum(x.max(axis=1, keepdims=True), 1e-300)
                below, held = below + ((ratio < smallest) & (x > 0)).sum(), held + (x > 0).sum()
            shares[f"{moment} {bits} bits"] = below / held
    return shares


def final_loss(losses: list[float]) -> float:
    """The mean of the last 10 steps' losses."""
    return sum(losses[-10:]) / len(losses[-10:])


def print_losses(args: argparse.Namespace, curves: dict) -> None:
    print("\n| model | state | final loss per seed | mean | vs float32 |\n|---|---|---|---:|---:|")
    for name in MODELS:
        mean = {}
        for bits in (32, 8, 4):
            finals = [final_loss(c) for s in args.seeds if (c := curves.get(f"{name}|{bits}|{s}"))]
            if len(finals) < len(args.seeds):
                continue
            mean[bits] = sum(finals) / len(finals)
            shown = ", ".join(f"{f:.4f}" for f in finals)
            change = f"{mean[bits] / mean[32] - 1:+.2%}" if 32 in mean else "-"
            print(f"| {MODELS[name][0]} | {bits} bits | {shown} | {mean[bits]:.4f} | {change} |")


def plot(args: argparse.Namespace, curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(args.models), figsize=(6 * len(args.models), 4))
    for ax, name in zip(np.atleast_1d(axes), args.models, strict=True):
        for bits in (32, 8, 4):
            runs = [curves.get(f"{name}|{bits}|{s}") for s in args.seeds]
            if all(runs):
                ax.plot(np.mean(runs, axis=0), label=f"{bits}-bit state", linewidth=1)
        text = "fresh Markov text" if args.data == "markov" else "its 5 kB text"
        title = f"{MODELS[name][0]} on {text}, mean of {len(args.seeds)} seeds"
        ax.set(title=title, xlabel="step", ylabel="loss", yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


MODELS = {"demo": ("demo LM", demo_model), "gpt": ("stacked GPT", stacked_model)}


if __name__ == "__main__":
    main()
