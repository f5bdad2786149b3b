"""A Flax NNX transformer with stacked layers and dropout, trained in ZeRO stages 1-3.

    python examples/scan_transformer.py [--devices 8] [--layers 4] [--d-model 64]

The blocks are made with ``nnx.vmap`` (every block weight is one stacked leaf with a
leading layer axis) and run with ``nnx.scan``; dropout draws from a per-step key.
``zs.sharded(..., stacked=["blocks"])`` cuts the stacked leaves layer by layer, so
each device holds 1/N of every layer. Stages 1 and 2 run the model as written; stage
3 keeps the weights as pieces and its loss scans over them, gathering one block per
iteration (``zeroshard.flax.nnx_layer``). The script trains each stage on the same
batches and keys, checks that they end at the same loss, and prints the memory per
device by stage.
"""

from __future__ import annotations

import argparse
import os
from importlib import resources


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--context", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax
    from flax import nnx

    import zeroshard as zs
    import zeroshard.flax as zf

    text = resources.files("zeroshard").joinpath("data/corpus.txt").read_text()
    vocab = sorted(set(text))
    tokens = np.array([vocab.index(c) for c in text], np.int32)
    d, layers = args.d_model, args.layers

    class Block(nnx.Module):
        """Pre-norm causal self-attention and MLP, with dropout on both."""

        def __init__(self, rngs: nnx.Rngs):
            self.norm1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(4, d, decode=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)
            self.dropout = nnx.Dropout(args.dropout)

        def __call__(self, x, key):
            k1, k2 = jax.random.split(key)
            mask = nnx.make_causal_mask(x[..., 0])
            x = x + self.dropout(self.attn(self.norm1(x), mask=mask), rngs=k1)
            return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))), rngs=k2)

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(len(vocab), d, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs):
                return Block(rngs)

            self.blocks = stack(rngs)
            self.head = nnx.Linear(d, len(vocab), rngs=rngs)

        def __call__(self, ids, key):
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
            def body(x, block, key):
                return block(x, key)

            x = body(self.embed(ids), self.blocks, jax.random.split(key, layers))
            return self.head(x)

    def xent(logits, ids):
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

    graphdef, params = nnx.split(LM(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)

    def loss_fn(params, batch, key):  # stages 1 and 2: the model as written
        ids = batch["tokens"]
        return xent(nnx.merge(graphdef, nnx.State(params))(ids[:, :-1], key), ids[:, 1:])

    template = Block(nnx.Rngs(1))  # the structure one stacked block gathers into
    model = nnx.merge(graphdef, nnx.State(params))

    def stage3_loss(params, batch, key):  # stage 3: one block gathered per iteration
        ids = batch["tokens"]
        x = zf.nnx_layer(model.embed)(params["embed"], ids[:, :-1])
        block = zf.nnx_layer(template)

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def body(x, p, key):
            return block(p, x, key)

        x = body(x, params["blocks"], jax.random.split(key, layers))
        return xent(zf.nnx_layer(model.head)(params["head"], x), ids[:, 1:])

    def batch_at(step: int) -> dict:
        rng = np.random.default_rng(step)
        starts = rng.integers(0, len(tokens) - args.context - 1, args.batch)
        return {"tokens": np.stack([tokens[s : s + args.context + 1] for s in starts])}

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    tx = zs.sharded(optax.adamw(3e-3), axis_name="data", stacked=["blocks"])
    size = sum(x.size for x in jax.tree.leaves(params))
    print(f"{layers} stacked blocks, d_model {d}, {size:,} parameters, {n} devices")
    results = {}
    for stage in (1, 2, 3):
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        step = zs.make_train_step(stage3_loss if stage == 3 else loss_fn, tx, mesh, stage=stage)
        key = jax.random.key(0)
        memory = step.lower(state, batch_at(0), key).compile().memory_analysis()
        state_bytes = zs.state_bytes_per_device(state)
        for i in range(args.steps):
            state, metrics = step(state, batch_at(i), jax.random.fold_in(key, i))
        loss = float(metrics["loss"])
        results[stage] = {"loss": loss, "state": state_bytes, "temp": memory.temp_size_in_bytes}
        print(f"  stage {stage}: loss after {args.steps} steps {loss:.4f}")
    print("\nmemory per device (bytes)")
    print("| stage | params + optimizer state | compiled step: temporaries |")
    print("|---|---:|---:|")
    for stage, r in results.items():
        print(f"| {stage} | {r['state']:,} | {r['temp']:,} |")
    losses = [r["loss"] for r in results.values()]
    if max(losses) - min(losses) > 1e-3 * max(losses):
        raise SystemExit(f"the stages disagree: {losses}")
    return results


if __name__ == "__main__":
    main()
