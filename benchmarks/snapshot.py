"""Bit-identity snapshot: every number of a fixed set of short runs, to compare bitwise.

Each case trains a small model 3 steps (bf16 parameters, fp32 masters) and records
the parameters (not stage 3's pieces), ``zs.to_optax_state`` (the fp32 masters and the
inner state as plain optax holds it) and every step's loss and grad norm. Cases:

- ``{opt}-s{stage}-a{accum}-n{N}``: ``zs.make_train_step`` with sgd, adamw, lamb,
  adafactor, muon (each after ``optax.clip_by_global_norm(1.0)``) x stages 1-3 x
  ``accum_steps`` 1, 2 x N of ``--devices`` (default 1, 3, 8);
- ``dropin-{jit,shard_map}-{adamw,adafactor}-n8``: ``tx.init``/``tx.update`` +
  ``optax.apply_updates`` in a user's ``jax.jit``, and in a user's ``jax.shard_map``;
- ``nnx-adamw-n8``, ``linen-adamw-n8``: the Flax steps (stage 1).

The model: a (256, 128) and a (128, 256) matrix, 2 stacked (128, 128) layers under
``jax.lax.scan`` (``stacked=``; ``zs.layer`` in stage 3), a (256, 37) head (a size
prime to 3) and a bias of 37. Seeds are fixed. Usage, from a checkout's root::

    PYTHONPATH=$PWD python benchmarks/snapshot.py --out new.npz [--only 'adamw-s3']
    python benchmarks/snapshot.py --compare base.npz new.npz  # exit 1 if a bit differs
    PYTHONPATH=$PWD python benchmarks/snapshot.py --out new.npz --against base.npz

Keys are ``{case}|{what}{path}``; floats narrower than fp32 are stored as fp32 (exact).
The comparison prints one markdown line per case and fails on any differing bit (NaN
positions included), shape, dtype or missing array. XLA may keep a value it rounds to
bf16 in float32 instead (its excess precision), where the fusions let it: take both
runs with ``XLA_FLAGS=--xla_allow_excess_precision=false`` to compare programs whose
fusions differ.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
import zeroshard.flax as zf

STEPS, BATCH, LAYERS = 3, 48, 2
INNER = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
}


def optimizer(name: str, **options) -> zs.ShardedTransformation:
    """``INNER[name]`` after ``optax.clip_by_global_norm(1.0)``, sharded over ``"data"``."""
    inner = optax.chain(optax.clip_by_global_norm(1.0), INNER[name]())
    return zs.sharded(inner, axis_name="data", **options)


def model(seed: int = 0) -> tuple[dict, list[dict]]:
    """The parameters (fp32) and ``STEPS`` batches."""
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s) / s[-2 if len(s) > 1 else 0] ** 0.5, jnp.float32)
    params = {
        "embed": f(256, 128),
        "blocks": {"w": f(LAYERS, 128, 128), "b": f(LAYERS, 128) / 10},
        "proj": f(128, 256),
        "head": f(256, 37),
        "bias": f(37) / 10,
    }
    y = lambda: jnp.asarray(rng.normal(size=(BATCH, 37)), jnp.float32)
    return params, [{"x": f(BATCH, 256) * 16, "y": y()} for _ in range(STEPS)]


def block(p: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32))


def loss_fn(params: dict, batch: dict, stage: int = 1) -> jax.Array:
    """Squared error of the model; in stage 3 the pieces are gathered (blocks per layer)."""
    rest = {k: v for k, v in params.items() if k != "blocks"}
    rest = jax.tree.map(lambda x: x.astype(jnp.float32), zs.gather(rest) if stage == 3 else rest)
    apply = zs.layer(block) if stage == 3 else block
    h = jnp.tanh(batch["x"] @ rest["embed"])
    h, _ = jax.lax.scan(lambda h, p: (apply(p, h), None), h, params["blocks"])
    out = jnp.tanh(h @ rest["proj"]) @ rest["head"] + rest["bias"]
    return jnp.mean((out - batch["y"]) ** 2)


def logical(params, opt_state, tx, mesh, compute=None) -> dict:
    """``zs.to_optax_state`` (the fp32 masters, the inner state as plain optax holds
    it) and, given, the compute parameters."""
    # On the mesh the state's arrays are typed on (a Flax step returns them on the
    # mesh's Auto twin outside a mesh context).
    on = jax.tree.leaves(opt_state)[0].sharding.mesh
    step = jax.device_put(jnp.int32(STEPS), NamedSharding(on, P()))
    master, inner_state = zs.to_optax_state(zs.TrainState(step, params, opt_state), tx)
    return {"master": master, "opt": inner_state, "params": compute}


def make_mesh(n: int) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def run_step(name: str, stage: int, accum: int, n: int) -> tuple[dict, list]:
    """``zs.make_train_step``."""
    (params, data), mesh = model(), make_mesh(n)
    tx = optimizer(name, stacked=("blocks",))
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
    loss = lambda p, b: loss_fn(p, b, stage)
    step = zs.make_train_step(loss, tx, mesh, stage=stage, accum_steps=accum)
    metrics = []
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    compute = state.params if stage < 3 else None
    return logical(state.params, state.opt_state, tx, mesh, compute), metrics


def run_dropin(name: str, how: str, n: int = 8) -> tuple[dict, list]:
    """``tx.init``/``tx.update`` in the user's ``jax.jit`` (``how="jit"``: the mean
    gradient) or ``jax.shard_map`` (``"shard_map"``: each device's own)."""
    (params, data), mesh = model(), make_mesh(n)
    tx = optimizer(name, stacked=("blocks",))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)

    def step(params, opt_state, batch):
        local = jax.lax.pcast(params, "data", to="varying") if how == "shard_map" else params
        loss, grads = jax.value_and_grad(loss_fn)(local, batch)
        loss = jax.lax.pmean(loss, "data") if how == "shard_map" else loss
        updates, opt_state = tx.update(grads, opt_state, params)
        m = {"loss": loss, "grad_norm": opt_state.grad_norm}
        return optax.apply_updates(params, updates), opt_state, m

    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        opt_state = tx.init(params)
        if how == "shard_map":
            specs = (P(), tx.state_specs(params, n))
            step = jax.shard_map(
                step, mesh=mesh, in_specs=(*specs, P("data")), out_specs=(*specs, P())
            )
        step, metrics = jax.jit(step), []
        for batch in data:
            params, opt_state, m = step(params, opt_state, jax.device_put(batch, P("data")))
            metrics.append(m)
    return logical(params, opt_state, tx, mesh, params), metrics


def run_flax(kind: str, n: int = 8) -> tuple[dict, list]:
    """``zeroshard.flax.nnx_train_step`` (``kind="nnx"``) or ``linen_train_step``."""
    (_, data), mesh, tx = model(), make_mesh(n), optimizer("adamw")
    mse = lambda out, b: jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)
    metrics = []
    if kind == "nnx":
        rngs = nnx.Rngs(0)
        net = nnx.Sequential(
            nnx.Linear(256, 128, rngs=rngs), jnp.tanh, nnx.Linear(128, 37, rngs=rngs)
        )
        opt = zf.nnx_optimizer(net, tx, mesh, param_dtype=jnp.bfloat16)
        step = zf.nnx_train_step(lambda m, b: mse(m(b["x"].astype(jnp.bfloat16)), b), mesh)
        for batch in data:
            metrics.append(step(net, opt, batch))
        params = nnx.as_pure(nnx.state(net, nnx.Param))
        compute = nnx.to_pure_dict(nnx.state(net, nnx.Param))
        return logical(params, nnx.as_pure(opt.opt_state), tx, mesh, compute), metrics
    net = nn.Sequential([nn.Dense(128), jnp.tanh, nn.Dense(37)])
    params = net.init(jax.random.key(0), jnp.ones((1, 256)))["params"]
    f32 = lambda p: jax.tree.map(lambda x: x.astype(jnp.float32), p)
    loss = lambda p, b: mse(net.apply({"params": f32(p)}, b["x"]), b)
    state = zf.linen_train_state(net.apply, params, tx, mesh, param_dtype=jnp.bfloat16)
    step = zf.linen_train_step(loss, tx, mesh)
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    return logical(state.params, state.opt_state, tx, mesh, state.params), metrics


def cases(devices: list[int]) -> dict:
    """``{name: (function, args)}``: the matrix, in order."""
    out = {
        f"{o}-s{s}-a{a}-n{n}": (run_step, (o, s, a, n))
        for n in devices
        for o in INNER
        for s in (1, 2, 3)
        for a in (1, 2)
    }
    for o in ("adamw", "adafactor"):
        for how in ("jit", "shard_map"):
            out[f"dropin-{how}-{o}-n8"] = (run_dropin, (o, how))
    out["nnx-adamw-n8"] = (run_flax, ("nnx",))
    out["linen-adamw-n8"] = (run_flax, ("linen",))
    return out


def flatten(case: str, trees: dict, metrics: list) -> dict[str, np.ndarray]:
    """``{"{case}|{what}{path}": array}``; floats narrower than fp32 widened (exactly)."""
    arrays = {
        f"{case}|{what}{jax.tree_util.keystr(path)}": np.asarray(x)
        for what, tree in trees.items()
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    for key in ("loss", "grad_norm"):
        arrays[f"{case}|{key}"] = np.stack([np.asarray(m[key]) for m in metrics])
    narrow = lambda x: x.dtype.itemsize < 4 and x.dtype.kind not in "iub"
    return {k: x.astype(np.float32) if narrow(x) else x for k, x in arrays.items()}


def record(path: str, only: str, devices: list[int]) -> None:
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
        f"wrote {len(arrays)} arrays, {len(todo)} cases, jax {jax.__version__}: {path}",
        file=sys.stderr,
    )


def difference(leaf: str, a: np.ndarray | None, b: np.ndarray | None) -> tuple[float, str] | None:
    """``None`` when ``a`` and ``b`` are the same bits, else ``(max abs diff, what)``."""
    if a is None or b is None:
        return float("inf"), f"{leaf} missing in {'base' if a is None else 'new'}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf"), f"{leaf}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    bits = lambda x: np.ascontiguousarray(x).view(np.uint8)
    if np.array_equal(bits(a), bits(b)):
        return None
    nan = (
        " (NaN positions differ)"
        if a.dtype.kind == "f" and (np.isnan(a) != np.isnan(b)).any()
        else ""
    )
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = float(np.nanmax(d)) if not np.isnan(d).all() else float("nan")
    return d, f"{leaf}{nan}"


def compare(base_path: str, new_path: str, only: str = "", ran: bool = False) -> int:
    """One markdown line per case; 1 if any array differs in any bit or is missing.
    ``ran``: only the cases ``new`` holds (those a ``--only``/``--devices`` run made)."""
    base, new = np.load(base_path), np.load(new_path)
    case_of, ran_cases = lambda k: k.split("|")[0], {k.split("|")[0] for k in new.files}
    wanted = lambda c: re.search(only, c) and (not ran or c in ran_cases)
    keys = sorted(k for k in {*base.files, *new.files} if wanted(case_of(k)))
    get = lambda f, k: f[k] if k in f.files else None
    by_case: dict[str, list] = {}
    for k in keys:
        case, leaf = k.split("|")
        diff = difference(leaf, get(base, k), get(new, k))
        by_case.setdefault(case, []).extend([diff] if diff else [])
    for case, diffs in by_case.items():
        if not diffs:
            print(f"- `{case}`: equal")
            continue
        worst = max(diffs, key=lambda d: (not np.isnan(d[0]), d[0]))
        others = [d[1] for d in diffs if d is not worst]
        others = f"; also {', '.join(others[:5])}{' ...' * (len(others) > 5)}" if others else ""
        head = f"**differs** ({len(diffs)} arrays): max abs diff {worst[0]:.3g} at {worst[1]}"
        print(f"- `{case}`: {head}{others}")
    failed = sum(bool(d) for d in by_case.values())
    print(f"\n{len(by_case) - failed}/{len(by_case)} cases bit-identical ({len(keys)} arrays).")
    return 1 if failed or not by_case else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="run the matrix and write the arrays to this .npz")
    parser.add_argument("--against", help="with --out: then compare it to this base .npz")
    parser.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="compare two files")
    parser.add_argument("--only", default="", help="regex: the cases to run (and compare)")
    parser.add_argument("--devices", default="1,3,8", help="device counts of the step matrix")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, args.only)
    if not args.out:
        parser.error("give --out FILE or --compare BASE NEW")
    jax.config.update("jax_num_cpu_devices", 8)  # before any array exists
    record(args.out, args.only, [int(n) for n in args.devices.split(",")])
    return compare(args.against, args.out, ran=True) if args.against else 0


if __name__ == "__main__":
    sys.exit(main())
