"""Demo: a Flax transformer language model trained data-parallel with zeroshard.

``python -m zeroshard.demo`` (or ``make demo``) trains a character-level transformer
on the text that ships with the package (``zeroshard/data/corpus.txt``), on simulated
CPU devices. It uses bf16 compute, fp32 master weights, global-norm clipping and
AdamW. It then:

- prints per-device memory by component, replicated optax vs zeroshard, read from
  live arrays and from XLA's analysis of both compiled steps;
- saves a checkpoint halfway, restores it on half the devices, and shows that the
  resumed run continues the loss curve;
- is preemption-safe: on SIGTERM it finishes the step in flight, saves it and exits 0
  (:class:`zeroshard.PreemptionGuard`); run with the same ``--checkpoint-dir`` again,
  it resumes from the latest step;
- writes a plot of the loss curves and the memory table to a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="of the model's initial weights")
    parser.add_argument(
        "--state-bits",
        type=int,
        choices=(8, 4),
        help="store Adam's moments in 8 or 4 bits (zs.sharded(..., state_bits=))",
    )
    parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary dir")
    parser.add_argument("--plot", default="zeroshard_demo.png", help="'' for no plot")
    return parser.parse_args(argv)


def progress(step: int, total: int, loss: float, tokens_per_s: float) -> None:
    width = 30
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == total or not sys.stdout.isatty() else "\r"
    if end == "\n" and step % max(total // 10, 1) and step != total:
        return  # not a terminal: print every tenth of the run
    line = f"  [{bar}] {step:4d}/{total}  loss {loss:.4f}  {tokens_per_s:8,.0f} tok/s"
    print(line, end=end, flush=True)


def main(argv: list[str] | None = None) -> dict:
    """Runs the demo (see the module docstring): train with zeroshard, resume on half the
    devices, compare memory with replicated optax, sample, plot.

    Returns:
      The losses, the resumed run's losses, the memory table and the state ratio; only
      the losses and ``preempted_at`` when stopped by SIGTERM.
    """
    args = parse_args(argv)
    start_jax(args.devices, args.batch)
    n = args.devices
    text, vocab, tokens = corpus()
    batch_at = batches(tokens, args.batch, args.context)
    graphdef, params, loss_fn = transformer(args, len(vocab))
    # optax.clip_by_global_norm as it is: inside zs.sharded its global norm is summed
    # across devices (the replicated baseline runs the same optimizer).
    schedule = optax.cosine_decay_schedule(args.lr, args.steps, 0.1)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    tx = zs.sharded(inner, axis_name="data", state_bits=args.state_bits)
    mesh = jax.make_mesh((n,), ("data",))
    size = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"zeroshard demo: {size:,}-parameter transformer LM ({args.layers} layers, d_model "
        f"{args.d_model}) on {len(text):,} characters of text, {n} simulated CPU devices,\n"
        f"global batch {args.batch} x {args.context} tokens, bf16 compute, fp32 master, "
        "AdamW + global-norm clipping"
        + (f", Adam's moments in {args.state_bits} bits." if args.state_bits else ".")
    )

    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="zeroshard_demo_")
    ckpt = zs.CheckpointManager(directory, tx, max_to_keep=None)
    save_at = args.steps // 2
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    train_step = zs.make_train_step(loss_fn, tx, mesh)
    state, losses, ours_mem, stopped = train(args, mesh, state, train_step, batch_at, ckpt, save_at)
    if stopped is not None:  # preempted: the step saved
        return {"losses": losses, "preempted_at": stopped}
    resumed, m = resume_on_half(ckpt, tx, loss_fn, state.params, batch_at, losses, save_at)
    ckpt.close()

    replicated, base_mem = replicated_optax(params, inner, loss_fn, mesh, batch_at)
    table, state_ratio = report_memory(replicated, base_mem, state, ours_mem, loss_fn, batch_at)
    print_sample(graphdef, state.params, tokens, vocab, args.context, args.steps)

    if args.plot:
        plot(args.plot, losses, resumed, save_at, m, table, n)
        print(f"Wrote {args.plot}")
    return {"losses": losses, "resumed": resumed, "memory": table, "state_ratio": state_ratio}


def start_jax(devices: int, batch: int) -> None:
    """Starts JAX on ``devices`` simulated CPU devices (exits if it cannot)."""
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS", "cpu"))
    jax.config.update("jax_num_cpu_devices", devices)
    if jax.device_count() != devices:
        raise SystemExit(f"JAX already started with {jax.device_count()} devices.")
    if batch % devices or (devices % 2 and devices > 1):
        raise SystemExit(
            f"--batch must divide by --devices ({devices}), and --devices be even or 1."
        )


def corpus():
    """The text that ships with the package, its characters, and it as token ids."""
    text = resources.files("zeroshard").joinpath("data/corpus.txt").read_text()
    vocab = sorted(set(text))
    tokens = np.array([vocab.index(c) for c in text], np.int32)
    return text, vocab, tokens


def batches(tokens, batch: int, context: int):
    """``batch_at(step)``: the global batch of step ``step`` (the same on every run)."""

    def batch_at(step: int) -> dict:
        starts = np.random.default_rng(step).integers(0, len(tokens) - context - 1, batch)
        return {"tokens": np.stack([tokens[s : s + context + 1] for s in starts])}

    return batch_at


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
    def __init__(self, args: argparse.Namespace, vocab_size: int, rngs: nnx.Rngs):
        d = args.d_model
        self.embed = nnx.Embed(vocab_size, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (args.context, d)))
        self.blocks = nnx.List([Block(d, args.heads, rngs) for _ in range(args.layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids) + self.pos[...][: ids.shape[1]].astype(self.embed.embedding.dtype)
        mask = nnx.make_causal_mask(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


def transformer(args: argparse.Namespace, vocab_size: int):
    """The model: ``(graphdef, params, loss_fn)``, the parameters as a dict of fp32
    arrays and ``loss_fn(params, batch)`` the model's next-token cross-entropy."""
    model = TransformerLM(args, vocab_size, nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p: dict, batch: dict) -> jax.Array:
        model = nnx.merge(graphdef, nnx.State(p))
        ids = batch["tokens"]
        logits = model(ids[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    fp32 = jax.tree.map(lambda x: x.astype(jnp.float32), nnx.to_pure_dict(params))
    return graphdef, fp32, loss_fn


def train(args, mesh, state, train_step, batch_at, ckpt, save_at):
    """Trains up to ``args.steps``, resuming from the latest step of ``ckpt`` if any and
    saving step ``save_at``; on SIGTERM saves the step and stops.

    Returns:
      ``(state, losses, memory, preempted_at)``: ``preempted_at`` is the step saved
      when stopped by SIGTERM, else ``None``; ``memory`` XLA's memory analysis of the
      compiled train step.
    """
    first = ckpt.latest_step() or 0
    if first:  # a previous run of this command was preempted: continue it
        state = ckpt.restore(mesh, like=state.params)
        print(f"Resuming from step {first} in {ckpt.directory}")
    losses: list[float] = [float("nan")] * first  # not known for steps run before
    memory = train_step.lower(state, batch_at(0)).compile().memory_analysis()
    guard = zs.PreemptionGuard()  # SIGTERM: finish the step in flight, save, exit 0
    start = time.perf_counter()
    print(f"Training, checkpoint at step {save_at} in {ckpt.directory}:")
    for step in range(first + 1, args.steps + 1):
        state, metrics = train_step(state, batch_at(step - 1))
        losses.append(float(metrics["loss"]))
        if step == save_at:
            ckpt.save(state)  # async: the next step donates the state right away
        if guard.should_stop(step):
            if step != save_at:  # else saved just above
                ckpt.save(state)
            ckpt.close()  # waits until the step is committed on disk
            print(f"Preempted: saved step {step} in {ckpt.directory}; run the same command")
            print(f"(with --checkpoint-dir {ckpt.directory}) again to resume.")
            return state, losses, memory, step
        rate = (step - first) * args.batch * args.context / (time.perf_counter() - start)
        progress(step, args.steps, losses[-1], rate)
    ckpt.wait_until_finished()
    return state, losses, memory, None


def resume_on_half(ckpt, tx, loss_fn, like, batch_at, losses, save_at):
    """Restores step ``save_at`` on half the devices and trains to the end again, to
    compare with ``losses``, the uninterrupted run's (one per step).

    Returns:
      ``(resumed, m)``: the resumed run's losses and its device count.
    """
    m = max(jax.device_count() // 2, 1)
    half = jax.make_mesh((m,), ("data",), devices=jax.devices()[:m])
    resumed_state = ckpt.restore(half, like=like, step=save_at)
    resumed_step = zs.make_train_step(loss_fn, tx, half)
    resumed: list[float] = []
    for step in range(save_at, len(losses)):
        resumed_state, metrics = resumed_step(resumed_state, batch_at(step))
        resumed.append(float(metrics["loss"]))
    pairs = zip(resumed, losses[save_at:], strict=True)
    gap = max((abs(a - b) for a, b in pairs if not np.isnan(b)), default=float("nan"))
    print(
        f"Resumed step {save_at} on {m} devices: final loss {resumed[-1]:.4f} vs "
        f"{losses[-1]:.4f} uninterrupted (largest gap over {len(resumed)} steps: {gap:.1e})"
    )
    return resumed, m


def replicated_optax(params, inner, loss_fn, mesh, batch_at):
    """Plain optax data parallelism: what it keeps on every device, ``(bf16 params, fp32
    master, moments)``, and XLA's memory analysis of its step, compiled."""
    to_bf16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
    state = jax.device_put((to_bf16(params), params, inner.init(params)), NamedSharding(mesh, P()))

    def replicated_step(p, master, opt_state, batch):
        grads = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.lax.pmean(grads, "data"))
        updates, opt_state = inner.update(grads, opt_state, master)
        master = optax.apply_updates(master, updates)
        return to_bf16(master), master, opt_state

    specs = (P(), P(), P(), P("data"))
    step = jax.shard_map(replicated_step, mesh=mesh, in_specs=specs, out_specs=specs[:3])
    baseline = jax.jit(step, donate_argnums=(0, 1, 2))
    batch = jax.device_put(batch_at(0), NamedSharding(mesh, P("data")))
    return state, baseline.lower(*state, batch).compile().memory_analysis()


def report_memory(replicated, base_mem, state, ours_mem, loss_fn, batch_at):
    """Prints bytes per device by component, replicated optax vs zeroshard: of live
    arrays, and of XLA's memory analysis of both compiled steps.

    Returns:
      ``(table, state_ratio)``: ``{name: (replicated optax, zeroshard)}`` of the arrays,
      and optimizer state + master per device as a fraction of replicated.
    """
    rep_params, rep_master, rep_moments = replicated
    grads = jax.eval_shape(jax.grad(loss_fn), state.params, batch_at(0))  # bf16, full size
    rows = {
        "params (bf16, replicated)": (rep_params, state.params),
        "grads (bf16, full local; by shape)": (grads, grads),
        "AdamW moments (fp32)": (rep_moments, state.opt_state.inner_state),
        "master weights (fp32)": (rep_master, state.opt_state.master),
    }
    table = {k: tuple(map(zs.state_bytes_per_device, pair)) for k, pair in rows.items()}
    n = jax.device_count()
    print(f"\nPer-device memory on {n} devices (bytes):\n")
    print("| component | replicated optax | zeroshard | ratio |")
    print("|---|---:|---:|---:|")
    sizes = lambda attr: (getattr(base_mem, attr), getattr(ours_mem, attr))
    compiled = {
        "compiled step: arguments": sizes("argument_size_in_bytes"),
        "compiled step: temporaries": sizes("temp_size_in_bytes"),
    }
    for name, (a, b) in {**table, **compiled}.items():
        print(f"| {name} | {a:,} | {b:,} | {b / a:.3f} |")
    state_rows = list(table.values())[2:]
    state_ratio = sum(b for _, b in state_rows) / sum(a for a, _ in state_rows)
    print(
        f"\nOptimizer state + master per device: {state_ratio:.4f} of replicated "
        f"(1/{n} = {1 / n:.4f}; the difference is padding and replicated scalars)."
    )
    return table, state_ratio


def print_sample(graphdef, params, tokens, vocab, context: int, steps: int) -> None:
    """Prints 120 characters sampled greedily from the trained model."""
    model = nnx.merge(graphdef, nnx.State(jax.device_get(params)))
    ids = list(tokens[:context])
    for _ in range(120):
        logits = model(jnp.asarray([ids[-context:]]))
        ids.append(int(jnp.argmax(logits[0, -1])))
    sample = "".join(vocab[i] for i in ids[context:])
    print(f"\nSample (greedy, after {steps} steps): {sample!r}")


def plot(path, losses, resumed, save_at, m, table, n) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(range(1, len(losses) + 1), losses, label=f"{n} devices")
    resumed_at = range(save_at + 1, save_at + len(resumed) + 1)
    left.plot(resumed_at, resumed, "--", label=f"resumed from step {save_at} on {m} devices")
    left.set(xlabel="step", ylabel="loss", title="training loss", yscale="log")
    left.legend()
    x = np.arange(len(table))
    for k, (label, shift) in enumerate([("replicated optax", -0.2), ("zeroshard", 0.2)]):
        right.bar(x + shift, [sizes[k] / 1e6 for sizes in table.values()], 0.4, label=label)
    right.set_xticks(x, [name.split(" (")[0] for name in table])
    right.set(ylabel="MB per device", title=f"memory per device, {n} devices")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
