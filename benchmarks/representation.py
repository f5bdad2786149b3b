"""Representation of a device's part of the state: per-leaf pieces or one flat row per dtype.

Measures, at several leaf counts, four ways of holding the master weights and the
optimizer state of a data-parallel step on ``--devices`` devices, side by side:

- ``R``: replicated data parallelism (``baseline.replicated_step``: ``pmean`` and plain
  optax; with ``--dtypes bf16`` a replicated fp32 master as well);
- ``Z``: zeroshard as it is, ``zs.make_train_step`` stage 1 (per-leaf pieces for the
  inner state, one row per dtype for the master when params are bf16);
- ``P``: a prototype holding per-leaf pieces for both the master and the optimizer
  state (one array per leaf per state kind). Gradients are reduce-scattered and
  weights all-gathered as zeroshard does: leaves under ``--pack-bytes`` packed per
  dtype into groups of at most that many bytes (one collective per group), larger
  leaves alone; the optimizer runs on the tree of pieces;
- ``F``: a prototype holding ONE flat row per dtype for the master and the optimizer
  state (the optimizer runs on a single 1-D array per dtype, as ``optax.flatten``
  does). Each leaf's gradient is raveled, padded to a multiple of N and cut into N
  column blocks; the blocks of all leaves of a dtype make an ``(N, row)`` matrix with
  one ``psum_scatter``; one ``all_gather`` of the new row, leaves sliced back out.
  With fp32 params ``F`` takes its master row from the params each step (like ``Z``
  and ``P``: no extra bytes); ``F+m`` keeps an fp32 master row in the state instead.

``--variants ... G`` adds a floor that is no candidate: the gradient, its ``pmean`` and
a plain SGD step with no optimizer state (what every variant compiles at least).

The model is ``L / 2`` dense tanh layers of width ``--width`` (a weight and a bias:
``L`` leaves), as in ``startup.py``. Every variant of one leaf count runs in one fresh
process, after a warm-up of every variant on a 2-leaf model (so the first variant does
not pay the process's one-off costs); the variants are started in turn, then stepped
interleaved step by step. Per variant:

- startup: state init, ``jit(...).trace``, ``.lower()``, ``.compile()`` (XLA) and the
  first run of the compiled step, each timed (``--repeats`` fresh ``jax.jit`` per
  variant, median); also the process's CPU time (``time.process_time``, all threads)
  of the compile and of the whole first step, which a machine shared with other work
  disturbs less than wall time;
- the median step time over ``--steps`` steps;
- optimizer-state + master bytes per device (``addressable_shards[0]``), the number of
  those arrays and of the step's argument arrays, the HLO instructions of the compiled
  step (lines of ``compiled.as_text()`` with ``" = "``) and its collectives.

``--check`` first asserts that ``P``, ``F`` and ``F+m`` (and ``R``, ``Z``) give plain
optax's result on one device for a few steps (SGD and AdamW; fp32 and bf16).

    .venv-newest/bin/python benchmarks/representation.py --check --leaves 32 512 2048
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

STAGES = ("init", "trace", "lower", "compile", "first run")
COLLECTIVES = ("reduce-scatter", "all-gather", "all-reduce")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[32, 512, 2048])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--repeats", type=int, default=1, help="fresh jits per variant")
    parser.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], default="adamw")
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32"])
    parser.add_argument("--variants", nargs="+", default=["R", "Z", "P", "F", "F+m"])
    parser.add_argument("--pack-bytes", type=int, default=1 << 18, help="P's packing")
    parser.add_argument("--check", action="store_true", help="assert against plain optax")
    parser.add_argument("--out", default="benchmarks/results", help="JSON goes here")
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "LEAVES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dtype, leaves = args.child
        print(json.dumps(measure(args, dtype, int(leaves))))
        return
    if args.check:
        run_child(args, ["--check-only"])
    results, machine = [], None
    for dtype in args.dtypes:
        for leaves in args.leaves:
            t0 = time.perf_counter()
            out = run_child(args, ["--child", dtype, str(leaves)])
            machine = out["machine"]
            results += out["rows"]
            print(f"{dtype}, {leaves} leaves: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print_tables(results, machine, args)
    os.makedirs(args.out, exist_ok=True)
    tag = "-".join(args.dtypes + [str(x) for x in args.leaves])
    with open(os.path.join(args.out, f"representation-{tag}.json"), "w") as f:
        json.dump({"machine": machine, "args": vars(args), "results": results}, f, indent=1)


def run_child(args, extra: list[str]) -> dict:
    if extra == ["--check-only"]:
        cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {here()!r}); "]
        cmd[-1] += "import representation as r; r.check(" + str(args.devices) + ")"
        subprocess.run(cmd, check=True)
        return {}
    cmd = [sys.executable, os.path.abspath(__file__), *extra]
    for flag in ("devices", "width", "batch", "steps", "warmup", "repeats", "optimizer"):
        cmd += [f"--{flag}", str(getattr(args, flag))]
    cmd += ["--pack-bytes", str(args.pack_bytes), "--variants", *args.variants]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def here() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def setup_jax(devices: int):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", devices)
    return jax


# The model.


def make_params(leaves: int, width: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        f"layer{i:04d}": {
            "w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
            "b": (0.1 * rng.normal(size=width)).astype(np.float32),
        }
        for i in range(leaves // 2)
    }


def make_batch(batch: int, width: int, seed: int = 1):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(batch, width)).astype(np.float32),
        "y": rng.normal(size=(batch, width)).astype(np.float32),
    }


def loss_fn(p, b):
    import jax.numpy as jnp

    layers = sorted(p)
    x = b["x"].astype(p[layers[0]]["w"].dtype)
    for k in layers:
        x = jnp.tanh(x @ p[k]["w"] + p[k]["b"])
    return jnp.mean((x.astype(jnp.float32) - b["y"]) ** 2)


def make_inner(name: str):
    import optax

    return {
        "adamw": lambda: optax.adamw(1e-2),
        "adam": lambda: optax.adam(1e-2),
        "sgd": lambda: optax.sgd(0.1),
    }[name]()


# Geometry shared by the prototypes: leaf i is raveled, padded to N * width_i and cut
# into N blocks of width_i; device d holds block d.


def widths(params, n: int) -> list[int]:
    import jax

    return [-(-math.prod(x.shape) // n) for x in jax.tree.leaves(params)]


def blocks(x, n: int, width: int):
    """``(n, width)``: the raveled, zero-padded leaf, row ``d`` for device ``d``."""
    import jax.numpy as jnp

    flat = jnp.ravel(x)
    return jnp.pad(flat, (0, n * width - flat.size)).reshape(n, width)


def uncut(full, shape):
    """The leaf from every device's block (``(n, width)``, as ``all_gather`` returns)."""
    return full.reshape(-1)[: math.prod(shape)].reshape(shape)


def my_block(x, n: int, width: int, axis: str):
    import jax

    return jax.lax.dynamic_index_in_dim(blocks(x, n, width), jax.lax.axis_index(axis), 0, False)


def pack_groups(params, pack_bytes: int) -> list[list[int]]:
    """zeroshard's grouping (``Layout.groups``): per dtype, leaves under ``pack_bytes``
    packed in leaf order into groups of at most ``pack_bytes``; larger leaves alone."""
    import jax

    leaves = jax.tree.leaves(params)
    groups = []
    for dtype in dict.fromkeys(x.dtype for x in leaves):
        members = [i for i, x in enumerate(leaves) if x.dtype == dtype]
        nbytes = {i: leaves[i].size * leaves[i].dtype.itemsize for i in members}
        run: list[int] = []
        for i in (i for i in members if nbytes[i] < pack_bytes):
            if run and sum(nbytes[j] for j in run) + nbytes[i] > pack_bytes:
                groups.append(run)
                run = []
            run.append(i)
        groups += [run] if run else []
        groups += [[i] for i in members if nbytes[i] >= pack_bytes]
    return groups


def buckets(params) -> list[list[int]]:
    """Leaf indices per dtype, in order of first appearance."""
    import jax

    leaves = jax.tree.leaves(params)
    return [
        [i for i, x in enumerate(leaves) if x.dtype == d]
        for d in dict.fromkeys(x.dtype for x in leaves)
    ]


# The variants. Each returns a dict: init(params32) -> state (blocking), jit (a fresh
# jax.jit), args(state) -> the step's arguments, next(out) -> state, opt(state) -> the
# optimizer state + master arrays.


def variant(name: str, params32, batch, mesh, inner, dtype, pack_bytes: int) -> dict:
    fns = {"R": replicated, "Z": zeroshard, "P": pieces, "F": flat, "F+m": flat_master}
    return (fns | {"G": gradient_only})[name](params32, batch, mesh, inner, dtype, pack_bytes)


def gradient_only(params32, batch, mesh, inner, dtype, pack_bytes):
    """Not a candidate: the floor under every variant, the gradient, its ``pmean`` and
    ``params - 0.1 * grad`` (no optimizer state)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def local(p, b):
        grads = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), b)
        grads = jax.lax.pmean(grads, "data")
        return jax.tree.map(lambda x, g: (x - 0.1 * g).astype(x.dtype), p, grads)

    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()),
        donate_argnums=(0,),
    )
    cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
    init = jax.jit(cast, out_shardings=NamedSharding(mesh, P()))
    return {
        "init": lambda p: jax.block_until_ready(init(p)),
        "jit": step,
        "args": lambda s: (s, batch),
        "next": lambda out: out,
        "opt": lambda s: (),
    }


def replicated(params32, batch, mesh, inner, dtype, pack_bytes):
    import jax
    import jax.numpy as jnp
    import optax
    from baseline import replicated_step
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rep = NamedSharding(mesh, P())
    if dtype == jnp.float32:
        step = replicated_step(loss_fn, inner, mesh)
        init = jax.jit(lambda p: (jax.tree.map(jnp.copy, p), inner.init(p)), out_shardings=rep)
        return {
            "init": lambda p: jax.block_until_ready(init(p)),
            "jit": step,
            "args": lambda s: (*s, batch),
            "next": lambda out: out,
            "opt": lambda s: s[1],
        }

    def local(p, m, s, b):  # compute in dtype, fp32 master replicated
        grads = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), b)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.lax.pmean(grads, "data"))
        updates, s = inner.update(grads, s, m)
        m = optax.apply_updates(m, updates)
        return jax.tree.map(lambda x: x.astype(dtype), m), m, s

    specs = (P(), P(), P(), P("data"))
    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:3]),
        donate_argnums=(0, 1, 2),
    )
    init = jax.jit(
        lambda p: (jax.tree.map(lambda x: x.astype(dtype), p), p, inner.init(p)),
        out_shardings=rep,
    )
    return {
        "init": lambda p: jax.block_until_ready(init(p)),
        "jit": step,
        "args": lambda s: (*s, batch),
        "next": lambda out: out,
        "opt": lambda s: (s[1], s[2]),
    }


def zeroshard(params32, batch, mesh, inner, dtype, pack_bytes):
    import jax
    import jax.numpy as jnp

    import zeroshard as zs

    holder = {}

    def init(p):
        tx = zs.sharded(inner, axis_name="data")  # fresh: no cached plan
        holder["step"] = zs.make_train_step(loss_fn, tx, mesh)
        param_dtype = None if dtype == jnp.float32 else dtype
        return jax.block_until_ready(zs.init_train_state(p, tx, mesh, param_dtype=param_dtype))

    return {
        "init": init,
        "jit": lambda: holder["step"].jitted,
        "args": lambda s: (s, batch, None),
        "next": lambda out: out[0],
        "opt": lambda s: s.opt_state,
    }


def _state_specs(tree, axis: str):
    """``P(axis)`` for the 1-D per-device parts, ``P()`` for scalars (adam's count)."""
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda x: P(axis) if x.ndim else P(), tree)


def pieces(params32, batch, mesh, inner, dtype, pack_bytes):
    """Per-leaf pieces for master and optimizer state; zeroshard's packed collectives."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["data"]
    treedef = jax.tree.structure(params32)
    shapes = [x.shape for x in jax.tree.leaves(params32)]
    cast_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params32)
    ws = widths(params32, n)
    groups = pack_groups(cast_params, pack_bytes)
    keep_master = dtype != jnp.float32
    f32 = jnp.float32

    def cut(tree):  # this device's piece of every leaf, fp32
        leaves = jax.tree.leaves(tree)
        return treedef.unflatten(
            my_block(x, n, w, "data").astype(f32) for x, w in zip(leaves, ws, strict=True)
        )

    piece_structs = treedef.unflatten(jax.ShapeDtypeStruct((w,), f32) for w in ws)
    opt_specs = _state_specs(jax.eval_shape(inner.init, piece_structs), "data")
    master_specs = treedef.unflatten(P("data") for _ in ws) if keep_master else None

    def local_init(p32):
        master = cut(p32)
        params = jax.tree.map(lambda x: x.astype(dtype), p32)
        return params, (master if keep_master else None), inner.init(master)

    init = jax.jit(
        jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=(P(), master_specs, opt_specs))
    )

    def local(params, master, opt, b):
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), b)
        g = jax.tree.leaves(grads)
        gp = [None] * len(g)
        for group in groups:
            mats = [blocks(g[i], n, ws[i]) for i in group]
            mat = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=1)
            row = jax.lax.psum_scatter(mat, "data", scatter_dimension=0, tiled=True)[0] / n
            start = 0
            for i in group:
                gp[i] = row[start : start + ws[i]].astype(f32)
                start += ws[i]
        gp = treedef.unflatten(gp)
        if master is None:
            master = cut(params)
        updates, opt = inner.update(gp, opt, master)
        master = optax.apply_updates(master, updates)
        new = jax.tree.leaves(master)
        out = [None] * len(new)
        for group in groups:
            own = [new[i].astype(dtype) for i in group]
            row = own[0] if len(own) == 1 else jnp.concatenate(own)
            full = jax.lax.all_gather(row, "data", tiled=False, to="invarying")
            start = 0
            for i in group:
                out[i] = uncut(full[:, start : start + ws[i]], shapes[i])
                start += ws[i]
        return treedef.unflatten(out), (master if keep_master else None), opt

    return _prototype(local, init, mesh, (master_specs, opt_specs), batch)


def flat_master(params32, batch, mesh, inner, dtype, pack_bytes):
    return flat(params32, batch, mesh, inner, dtype, pack_bytes, keep_master=True)


def flat(params32, batch, mesh, inner, dtype, pack_bytes, keep_master=None):
    """One flat fp32 row per dtype for master and optimizer state; one reduce-scatter
    and one all-gather per dtype."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["data"]
    treedef = jax.tree.structure(params32)
    shapes = [x.shape for x in jax.tree.leaves(params32)]
    cast_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params32)
    ws = widths(params32, n)
    bs = buckets(cast_params)
    if keep_master is None:
        keep_master = dtype != jnp.float32
    f32 = jnp.float32

    def matrix(leaves, bucket):  # (n, row): every device's blocks of the bucket's leaves
        mats = [blocks(leaves[i], n, ws[i]) for i in bucket]
        return mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=1)

    def rows(tree):  # this device's fp32 row per bucket
        leaves = jax.tree.leaves(tree)
        index = jax.lax.axis_index("data")
        return tuple(
            jax.lax.dynamic_index_in_dim(matrix(leaves, b), index, 0, False).astype(f32) for b in bs
        )

    row_structs = tuple(jax.ShapeDtypeStruct((sum(ws[i] for i in b),), f32) for b in bs)
    opt_specs = _state_specs(jax.eval_shape(inner.init, row_structs), "data")
    master_specs = tuple(P("data") for _ in bs) if keep_master else None

    def local_init(p32):
        master = rows(p32)
        params = jax.tree.map(lambda x: x.astype(dtype), p32)
        return params, (master if keep_master else None), inner.init(master)

    init = jax.jit(
        jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=(P(), master_specs, opt_specs))
    )

    def local(params, master, opt, b):
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), b)
        g = jax.tree.leaves(grads)
        grow = tuple(
            (
                jax.lax.psum_scatter(matrix(g, bk), "data", scatter_dimension=0, tiled=True)[0] / n
            ).astype(f32)
            for bk in bs
        )
        if master is None:
            master = rows(params)
        updates, opt = inner.update(grow, opt, master)
        master = optax.apply_updates(master, updates)
        out = [None] * len(shapes)
        for bk, row in zip(bs, master, strict=True):
            full = jax.lax.all_gather(row.astype(dtype), "data", tiled=False, to="invarying")
            start = 0
            for i in bk:
                out[i] = uncut(full[:, start : start + ws[i]], shapes[i])
                start += ws[i]
        return treedef.unflatten(out), (master if keep_master else None), opt

    return _prototype(local, init, mesh, (master_specs, opt_specs), batch)


def params_of(name: str, state):
    return state.params if name == "Z" else state if name == "G" else state[0]


# Correctness: every variant against plain optax on one device.


def check(devices: int) -> None:
    jax = setup_jax(devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    # Width 12: 144- and 12-element leaves, padded to a multiple of N on 8 devices.
    params32 = make_params(6, 12, seed=3)
    batch = make_batch(8 * devices, 12, seed=4)
    placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
    one = jax.devices()[0]
    for opt in ("sgd", "adamw"):
        for dtype, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)):
            inner = make_inner(opt)
            ref_step = reference_step(inner, dtype)
            m = jax.device_put(params32, one)
            s = inner.init(m)
            for _ in range(3):
                m, s = ref_step(m, s, jax.device_put(batch, one))
            want = [np.asarray(x.astype(dtype), np.float32) for x in jax.tree.leaves(m)]
            for name, pack in (("R", 0), ("Z", 0), ("P", 1 << 18), ("P", 0), ("F", 0), ("F+m", 0)):
                v = variant(name, params32, placed, mesh, inner, dtype, pack)
                state, step = v["init"](params32), v["jit"]
                step = step() if callable(step) and not hasattr(step, "lower") else step
                for _ in range(3):
                    state = v["next"](step(*v["args"](state)))
                got = jax.tree.map(lambda x: np.asarray(x, np.float32), params_of(name, state))
                got = np.concatenate([x.ravel() for x in jax.tree.leaves(got)])
                err = float(np.max(np.abs(got - np.concatenate([x.ravel() for x in want]))))
                np.testing.assert_allclose(
                    got,
                    np.concatenate([x.ravel() for x in want]),
                    atol=tol,
                    rtol=tol,
                    err_msg=f"{name}, {opt}, {jnp.dtype(dtype).name}",
                )
                name += f" (pack_bytes {pack})" if name == "P" else ""
                print(
                    f"check {name:21s} {opt:5s} {jnp.dtype(dtype).name:8s}: "
                    f"max |diff| {err:.2e} after 3 steps (tol {tol})",
                    file=sys.stderr,
                )


def reference_step(inner, dtype):
    """Plain optax on one device, full batch: compute in ``dtype``, fp32 master."""
    import jax
    import jax.numpy as jnp
    import optax

    @jax.jit
    def step(m, s, b):
        g = jax.grad(loss_fn)(jax.tree.map(lambda x: x.astype(dtype), m), b)
        u, s = inner.update(jax.tree.map(lambda x: x.astype(jnp.float32), g), s, m)
        return optax.apply_updates(m, u), s

    return step


# Measurement (one fresh process per dtype and leaf count).


def measure(args, dtype_name: str, leaves: int) -> dict:
    jax = setup_jax(args.devices)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    print(f"  zeroshard from {os.path.dirname(zs.__file__)}", file=sys.stderr)
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name]
    n = args.devices
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    inner = make_inner(args.optimizer)
    names = [v for v in args.variants if not (v == "F+m" and dtype_name != "fp32")]
    batch = jax.device_put(make_batch(args.batch, args.width), NamedSharding(mesh, P("data")))

    # Warm-up: every variant once on a 2-leaf model (process-wide one-off costs).
    small = make_params(2, args.width)
    for name in names:
        v = variant(name, small, batch, mesh, inner, dtype, args.pack_bytes)
        state = v["init"](small)
        step = v["jit"]() if name == "Z" else v["jit"]
        jax.block_until_ready(step(*v["args"](state)))

    params32 = make_params(leaves, args.width)
    rows = {
        name: {"times": {s: [] for s in STAGES}, "cpu": {"compile": [], "first step": []}}
        for name in names
    }
    live = {}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            v = variant(name, params32, batch, mesh, inner, dtype, args.pack_bytes)
            times, cpu = rows[name]["times"], rows[name]["cpu"]
            c0, t0 = time.process_time(), time.perf_counter()
            state = v["init"](params32)
            t1 = time.perf_counter()
            jitted = v["jit"]() if name == "Z" else v["jit"]
            step_args = v["args"](state)
            traced = jitted.trace(*step_args)
            t2 = time.perf_counter()
            lowered = traced.lower()
            c3, t3 = time.process_time(), time.perf_counter()
            compiled = lowered.compile()
            c4, t4 = time.process_time(), time.perf_counter()
            state = v["next"](jax.block_until_ready(compiled(*step_args)))
            c5, t5 = time.process_time(), time.perf_counter()
            for s, a, b in zip(STAGES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
                times[s].append(b - a)
            cpu["compile"].append(c4 - c3)
            cpu["first step"].append(c5 - c0)
            live[name] = (v, compiled, state)
            print(
                f"  {dtype_name} {leaves} {name}: first step {t5 - t0:.2f} s "
                f"(compile {t4 - t3:.2f})",
                file=sys.stderr,
            )
            del step_args

    for name, (v, compiled, state) in live.items():
        text = compiled.as_text()
        opt = v["opt"](state)
        row = rows[name]
        row.update(
            variant=name,
            dtype=dtype_name,
            leaves=leaves,
            params=sum(x.size for x in jax.tree.leaves(params32)),
            state_bytes=sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(opt)),
            state_arrays=len(jax.tree.leaves(opt)),
            step_args=len(jax.tree.leaves(v["args"](state))),
            hlo_instructions=sum(" = " in line for line in text.splitlines()),
            collectives={k: len(re.findall(rf"\s{k}(?:-start)?\(", text)) for k in COLLECTIVES},
            step_s=[],
        )
        row["all_times"], row["all_cpu"] = row["times"], row["cpu"]
        row["times"] = {s: statistics.median(t) for s, t in row["times"].items()}
        row["cpu"] = {s: statistics.median(t) for s, t in row["cpu"].items()}
        row["first_step_s"] = sum(row["times"].values())

    for i in range(args.warmup + args.steps):
        for name, (v, compiled, state) in live.items():
            t0 = time.perf_counter()
            state = v["next"](jax.block_until_ready(compiled(*v["args"](state))))
            if i >= args.warmup:
                rows[name]["step_s"].append(time.perf_counter() - t0)
            live[name] = (v, compiled, state)
    for row in rows.values():
        row["step_ms"] = 1e3 * statistics.median(row.pop("step_s"))
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if "model name" in line),
            platform.machine(),
        )
    machine = (
        f"{jax.devices()[0].device_kind} x{jax.device_count()} ({cpu}, {os.cpu_count()} "
        f"cores), jax {jax.__version__}"
    )
    return {"machine": machine, "rows": list(rows.values())}


def print_tables(results: list[dict], machine: str, args) -> None:
    for dtype in args.dtypes:
        rows = [r for r in results if r["dtype"] == dtype]
        if not rows:
            continue
        what = "fp32 params" if dtype == "fp32" else "bf16 params, fp32 master"
        print(
            f"\n### {what}, {args.optimizer}, {args.devices} devices, {args.width}-wide layers\n"
            f"\n{machine}; first step: median of {args.repeats} fresh jit(s); "
            f"step: median of {args.steps} interleaved steps\n"
        )
        print(
            "| leaves | variant | init s | trace+lower s | XLA compile s | first run s "
            "| first step s | vs R | CPU s: compile / first step | step ms | vs R "
            "| state B/device | state arrays | step args | HLO instr | RS / AG / AR |"
        )
        print("|---:|---|" + "---:|" * 14)
        for leaves in sorted({r["leaves"] for r in rows}):
            group = [r for r in rows if r["leaves"] == leaves]
            ref = next((r for r in group if r["variant"] == "R"), group[0])
            for r in group:
                t = r["times"]
                coll = " / ".join(str(r["collectives"][k]) for k in COLLECTIVES)
                print(
                    f"| {leaves} | {r['variant']} | {t['init']:.2f} | "
                    f"{t['trace'] + t['lower']:.2f} | {t['compile']:.2f} | "
                    f"{t['first run']:.2f} | {r['first_step_s']:.2f} | "
                    f"{r['first_step_s'] / ref['first_step_s']:.2f} | "
                    f"{r['cpu']['compile']:.2f} / {r['cpu']['first step']:.2f} | "
                    f"{r['step_ms']:.2f} | "
                    f"{r['step_ms'] / ref['step_ms']:.2f} | {r['state_bytes']:,} | "
                    f"{r['state_arrays']:,} | {r['step_args']:,} | "
                    f"{r['hlo_instructions']:,} | {coll} |"
                )


def _prototype(local, init, mesh, state_specs, batch):
    """A prototype's runner: its jitted ``shard_map`` step over (params, master, state)."""
    import jax
    from jax.sharding import PartitionSpec as P

    specs = (P(), *state_specs, P("data"))
    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:3]),
        donate_argnums=(0, 1, 2),
    )
    return {
        "init": lambda p: jax.block_until_ready(init(p)),
        "jit": step,
        "args": lambda s: (*s, batch),
        "next": lambda out: out,
        "opt": lambda s: (s[1], s[2]),
    }


if __name__ == "__main__":
    main()
