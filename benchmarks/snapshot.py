"""Bit-identity snapshot: every number a fixed set of short runs produces, to compare.

Records, after 3 steps of a small model (bf16 parameters with fp32 masters), for
each case: the parameters (stages 1 and 2: the bf16 compute copy), the logical state
of ``zs.to_optax_state`` (the fp32 master weights and the inner optimizer's state as
plain optax holds it) and every step's loss and grad norm. The cases:

- ``make_train_step``: sgd / adamw / lamb / adafactor / muon, each after
  ``optax.clip_by_global_norm(1.0)``, x stages 1-3 x ``accum_steps`` 1, 2 x N devices
  (default 1, 3, 8): keys ``{opt}-s{stage}-a{accum}-n{N}``;
- the drop-in (``tx.init`` / ``tx.update`` + ``optax.apply_updates``), adamw and
  adafactor at N = 8, in the user's ``jax.jit`` and in the user's ``jax.shard_map``:
  ``dropin-{jit,shard_map}-{opt}-n8``;
- the Flax steps, stage 1, adamw, N = 8: ``nnx-adamw-n8``, ``linen-adamw-n8``.

The model crosses the layout thresholds: an embedding-like (256, 128) matrix, a
(128, 256) one, 2 stacked (128, 128) layers under ``jax.lax.scan`` (``stacked=``; in
stage 3 each gathered by ``zs.layer``), a (256, 37) head (size not divisible by 3), a
bias of 37. Seeds are fixed: the same checkout gives the same bits.

Usage (from the repository root; the imported zeroshard is the one on PYTHONPATH)::

    PYTHONPATH=$PWD python benchmarks/snapshot.py --out new.npz [--only 'adamw-s3']
    python benchmarks/snapshot.py --compare base.npz new.npz   # exit 1 if any bit differs
    PYTHONPATH=$PWD python benchmarks/snapshot.py --out new.npz --against base.npz

Arrays are stored as float32 when their dtype is narrower (exact), keyed
``{case}|{what}{path}``. A comparison prints one markdown line per case and fails on
any bitwise difference (NaN positions included) or missing key.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import numpy as np

STEPS, BATCH, LAYERS = 3, 48, 2
OPTS = ("sgd", "adamw", "lamb", "adafactor", "muon")


def inner(name):
    import optax

    make = {
        "sgd": lambda: optax.sgd(0.1, momentum=0.9),
        "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
        "lamb": lambda: optax.lamb(1e-2),
        "adafactor": lambda: optax.adafactor(1e-2),
        "muon": lambda: optax.contrib.muon(1e-2),
    }[name]
    return optax.chain(optax.clip_by_global_norm(1.0), make())


def model(seed=0):
    """The parameters (fp32) and ``STEPS`` batches."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s) / s[-2 if len(s) > 1 else 0] ** 0.5, jnp.float32)
    params = {
        "embed": f(256, 128),
        "blocks": {"w": f(LAYERS, 128, 128), "b": f(LAYERS, 128) / 10},
        "proj": f(128, 256),
        "head": f(256, 37),
        "bias": f(37) / 10,
    }
    data = [
        {"x": f(BATCH, 256) * 16, "y": jnp.asarray(rng.normal(size=(BATCH, 37)), jnp.float32)}
        for _ in range(STEPS)
    ]
    return params, data


def block(p, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32))


def loss_fn(params, batch, stage=1):
    """Squared error of the model; in stage 3 the pieces are gathered (blocks per layer)."""
    import jax
    import jax.numpy as jnp

    import zeroshard as zs

    rest = {k: v for k, v in params.items() if k != "blocks"}
    rest = jax.tree.map(lambda x: x.astype(jnp.float32), zs.gather(rest) if stage == 3 else rest)
    apply = zs.layer(block) if stage == 3 else block
    h = jnp.tanh(batch["x"] @ rest["embed"])
    h, _ = jax.lax.scan(lambda h, p: (apply(p, h), None), h, params["blocks"])
    out = jnp.tanh(h @ rest["proj"]) @ rest["head"] + rest["bias"]
    return jnp.mean((out - batch["y"]) ** 2)


def logical(params, opt_state, tx, mesh):
    """``zs.to_optax_state``: the fp32 masters and the inner state as plain optax holds it."""
    import jax
    import jax.numpy as jnp

    import zeroshard as zs

    step = jax.device_put(jnp.int32(STEPS), jax.NamedSharding(mesh, jax.P()))
    state = zs.TrainState(step, params, opt_state)
    master, inner_state = zs.to_optax_state(state, tx)
    return {"master": master, "opt": inner_state}


def make_mesh(n):
    import jax

    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def run_step(name, stage, accum, n):
    import jax.numpy as jnp

    import zeroshard as zs

    params, data = model()
    mesh = make_mesh(n)
    tx = zs.sharded(inner(name), axis_name="data", stacked=("blocks",))
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
    step = zs.make_train_step(
        lambda p, b: loss_fn(p, b, stage), tx, mesh, stage=stage, accum_steps=accum
    )
    metrics = []
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    out = logical(state.params, state.opt_state, tx, mesh)
    if stage < 3:
        out["params"] = state.params
    return out, metrics


def run_dropin(name, how, n=8):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    params, data = model()
    mesh = make_mesh(n)
    tx = zs.sharded(inner(name), axis_name="data", stacked=("blocks",))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)

    def step(params, opt_state, batch):
        if how == "shard_map":
            local = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(loss_fn)(local, batch)
            loss = jax.lax.pmean(loss, "data")
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        m = {"loss": loss, "grad_norm": opt_state.grad_norm}
        return optax.apply_updates(params, updates), opt_state, m

    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        opt_state = tx.init(params)
        if how == "shard_map":
            specs = tx.state_specs(params, n)
            step = jax.shard_map(
                step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs, P())
            )
        step, metrics = jax.jit(step), []
        for batch in data:
            params, opt_state, m = step(params, opt_state, jax.device_put(batch, P("data")))
            metrics.append(m)
    out = logical(params, opt_state, tx, mesh)
    out["params"] = params
    return out, metrics


def run_flax(kind, n=8):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zeroshard as zs
    import zeroshard.flax as zf

    _, data = model()
    mesh, tx = make_mesh(n), zs.sharded(inner("adamw"), axis_name="data")
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    mse = lambda out, b: jnp.mean((out - b["y"]) ** 2)
    metrics = []
    if kind == "nnx":
        rngs = nnx.Rngs(0)
        net = nnx.Sequential(
            nnx.Linear(256, 128, rngs=rngs), jnp.tanh, nnx.Linear(128, 37, rngs=rngs)
        )
        optimizer = zf.nnx_optimizer(net, tx, mesh, param_dtype=jnp.bfloat16)
        step = zf.nnx_train_step(
            lambda m, b: mse(m(b["x"].astype(jnp.bfloat16)).astype(jnp.float32), b), mesh
        )
        for batch in data:
            metrics.append(step(net, optimizer, batch))
        params = nnx.as_pure(nnx.state(net, nnx.Param))
        out = logical(params, nnx.as_pure(optimizer.opt_state), tx, mesh)
        out["params"] = nnx.to_pure_dict(nnx.state(net, nnx.Param))
        return out, metrics
    net = nn.Sequential([nn.Dense(128), jnp.tanh, nn.Dense(37)])
    params = net.init(jax.random.key(0), jnp.ones((1, 256)))["params"]
    loss = lambda p, b: mse(net.apply({"params": f32(p)}, b["x"]), b)
    state = zf.linen_train_state(net.apply, params, tx, mesh, param_dtype=jnp.bfloat16)
    step = zf.linen_train_step(loss, tx, mesh)
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    out = logical(state.params, state.opt_state, tx, mesh)
    out["params"] = state.params
    return out, metrics


def cases(devices):
    """``{name: thunk}`` of the matrix, in order."""
    out = {
        f"{o}-s{s}-a{a}-n{n}": (run_step, (o, s, a, n))
        for n in devices
        for o in OPTS
        for s in (1, 2, 3)
        for a in (1, 2)
    }
    for o in ("adamw", "adafactor"):
        for how in ("jit", "shard_map"):
            out[f"dropin-{how}-{o}-n8"] = (run_dropin, (o, how))
    out["nnx-adamw-n8"] = (run_flax, ("nnx",))
    out["linen-adamw-n8"] = (run_flax, ("linen",))
    return out


def flatten(case, tree, metrics):
    import jax

    arrays = {}
    for what, sub in tree.items():
        for path, x in jax.tree_util.tree_leaves_with_path(sub):
            arrays[f"{case}|{what}{jax.tree_util.keystr(path)}"] = x
    for key in ("loss", "grad_norm"):
        arrays[f"{case}|{key}"] = np.stack([np.asarray(m[key], np.float32) for m in metrics])
    out = {}
    for k, x in arrays.items():
        x = np.asarray(x)
        out[k] = x.astype(np.float32) if x.dtype.itemsize < 4 and x.dtype.kind not in "iub" else x
    return out


def record(path, only, devices):
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    todo = {k: v for k, v in cases(devices).items() if re.search(only, k)}
    arrays, start = {}, time.perf_counter()
    for i, (case, (fn, args)) in enumerate(todo.items()):
        t = time.perf_counter()
        arrays.update(flatten(case, *fn(*args)))
        now = time.perf_counter()
        print(
            f"[{i + 1}/{len(todo)}] {case} {now - t:.1f}s (total {now - start:.0f}s)",
            file=sys.stderr,
        )
    np.savez(path, **arrays)
    print(
        f"wrote {len(arrays)} arrays of {len(todo)} cases to {path} with jax {jax.__version__}",
        file=sys.stderr,
    )


def same_bits(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
    )


def compare(base_path, new_path, only=""):
    base, new = np.load(base_path), np.load(new_path)
    keys = sorted(k for k in set(base.files) | set(new.files) if re.search(only, k.split("|")[0]))
    by_case: dict[str, list[str]] = {}
    for k in keys:
        by_case.setdefault(k.split("|")[0], []).append(k)
    failed = 0
    for case, ks in by_case.items():
        problems, worst = [], (0.0, "")
        for k in ks:
            if k not in base.files or k not in new.files:
                problems.append(
                    f"{k.split('|')[1]} missing in {'base' if k not in base.files else 'new'}"
                )
                continue
            a, b = base[k], new[k]
            if same_bits(a, b):
                continue
            leaf = k.split("|")[1]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{leaf}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
                continue
            d = np.abs(a.astype(np.float64) - b.astype(np.float64))
            d = float(np.nanmax(d)) if np.isfinite(d).any() else float("nan")
            problems.append(f"{leaf} (max abs diff {d:.3g})")
            worst = max(worst, (d, leaf))
        failed += bool(problems)
        line = (
            "equal"
            if not problems
            else f"**differs**: {len(problems)} arrays: " + "; ".join(problems[:4])
        )
        print(f"- `{case}`: {line}{' ...' if len(problems) > 4 else ''}")
    print(f"\n{len(by_case) - failed}/{len(by_case)} cases bit-identical.")
    return 1 if failed or not by_case else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="run the matrix and write the arrays to this .npz")
    parser.add_argument("--against", help="with --out: compare the new file to this one")
    parser.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="compare two files")
    parser.add_argument("--only", default="", help="regex: the cases to run (or compare)")
    parser.add_argument("--devices", default="1,3,8", help="device counts of the matrix")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, args.only)
    if not args.out:
        parser.error("give --out FILE or --compare BASE NEW")
    record(args.out, args.only, [int(n) for n in args.devices.split(",")])
    return compare(args.against, args.out, args.only) if args.against else 0


if __name__ == "__main__":
    sys.exit(main())
