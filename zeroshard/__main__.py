"""Command line.

- ``python -m zeroshard inspect DIR [--step K] [--json] [--verify]``: a checkpoint's
  metadata; ``--verify`` also reads every array of the step on this machine's devices
  and checks it against the checksums recorded at save (exit status 1 if it does not
  match), without the model or the optimizer.
- ``python -m zeroshard plan --params 7.5e9 --devices 64``: memory per device by stage.
  With ``--params mymodel:init_params`` (a function returning the parameter tree; it
  is traced with ``jax.eval_shape``, nothing is allocated) and ``--optimizer
  mymodel:make_tx`` (a function returning an optax transformation or
  ``zs.sharded(...)``), the bytes are those of the placement ``zs.sharded`` chooses,
  which it prints too: leaves sliced, owned and layer-owned, and per device the owned
  units, their bytes and update cost, and the imbalance. With ``--loss
  mymodel:loss_fn --batch mymodel:make_batch`` (the loss as ``zs.make_train_step``
  takes it, and a function returning the global batch; both with ``--params`` a
  function), it also prints each stage's compiled per-device peak
  (:func:`zeroshard.step_memory`: the step lowered on abstract values on ``--devices``
  simulated CPU devices, nothing allocated).
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def inspect(args: argparse.Namespace) -> int:
    """``inspect``: prints the metadata record of a checkpoint's ``--step`` (``--json``:
    as it is), without loading any array unless ``--verify``: then every array of the
    step is read and checked against its checksum."""
    from zeroshard.checkpointing import CheckpointManager

    manager = CheckpointManager(args.directory)
    try:
        meta = manager.metadata(args.step)
    except (FileNotFoundError, ValueError) as e:
        print(f"zeroshard inspect: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(meta, indent=2))
    else:
        _describe(manager, meta)
    if not args.verify:
        return 0
    try:
        count = manager.verify(meta["step"])
    except (FileNotFoundError, ValueError) as e:
        print(f"zeroshard inspect: verify FAILED: {e}", file=sys.stderr)
        return 1
    print(f"verified step {meta['step']}: all {count} leaves match the checksums recorded at save")
    return 0


def _describe(manager, meta: dict) -> None:
    count = sum(math.prod(v["shape"]) for v in meta["params"].values())
    print(f"{manager.directory}: steps {manager.all_steps()}, showing step {meta['step']}")
    for key in ("format", "zeroshard_version", "jax_version", "optax_version", "saved_at"):
        print(f"  {key}: {meta[key]}")
    print(
        f"  saved on {meta['num_shards']} devices along axis {meta['axis_name']!r} "
        f"(mesh {meta['mesh_shape']}); restores on any device count\n"
        f"  master dtype: {meta['master_dtype']}; {count:,} parameters "
        f"in {len(meta['params'])} leaves\n"
        f"  param tree: {meta['param_tree']}\n"
        "  parameters (shape, compute dtype -> saved master dtype):"
    )
    for path, leaf in meta["params"].items():
        print(f"    {path}: {leaf['shape']} {meta['param_dtypes'][path]} -> {leaf['dtype']}")
    print(f"  optimizer state ({len(meta['opt_state'])} leaves):")
    for path, leaf in meta["opt_state"].items():
        print(f"    {path}: {leaf['shape']} {leaf['dtype']}")
    sums = meta.get("checksums")
    print(
        f"  checksums: {sums['algorithm']} of every leaf (check: --verify)"
        if sums
        else "  checksums: none (saved before they were recorded; cannot be verified)"
    )


def plan_command(args: argparse.Namespace) -> int:
    """``plan``: prints model-state bytes per device for ZeRO stages 0-3 on
    ``--devices`` or a ``--mesh`` of that shape (axis name -> size), and the placement
    when ``--params`` and ``--optimizer`` name functions (``module:function``); with
    ``--loss`` and ``--batch``, each stage's compiled peak; ``--param-specs``: a
    function returning the parameters' ``PartitionSpec``s on that mesh (their layout,
    which the step keeps)."""
    import jax

    devices, param_dtype, optimizer = args.mesh or args.devices, args.param_dtype, args.optimizer
    count = math.prod(devices.values()) if isinstance(devices, dict) else devices
    if args.loss is not None:  # (before JAX starts: the devices to plan for, simulated)
        jax.config.update("jax_num_cpu_devices", count)
    from zeroshard.measuring.memory import param_count, placement_table, plan_table, state_devices

    try:
        tree = jax.eval_shape(_load(args.params)) if ":" in args.params else float(args.params)
        tx = _load(optimizer)() if ":" in optimizer else optimizer
        loss_fn = None if args.loss is None else _load(args.loss)
        batch = None if args.batch is None else jax.eval_shape(_load(args.batch))
        specs = None if args.param_specs is None else _load(args.param_specs)()
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        print(f"zeroshard plan: {e}", file=sys.stderr)
        return 1
    where = f"a {devices} mesh" if isinstance(devices, dict) else f"{devices} devices"
    print(
        f"{param_count(tree):,.0f} parameters on {where}, {param_dtype} params and "
        f"grads, {optimizer}, fp32 master where the params are narrower (per device):\n"
    )
    print(plan_table(tree, devices, param_dtype=param_dtype, optimizer=tx, param_specs=specs))
    if not isinstance(tree, float) and hasattr(tx, "init"):
        n = state_devices(devices, tx)
        print(f"\nplacement (zs.sharded):\n\n{placement_table(tree, n, tx, param_dtype)}")
    if loss_fn is not None:
        print(f"\n{peak_table(loss_fn, tree, batch, tx, devices, param_dtype, specs)}")
    return 0


def peak_table(
    loss_fn, params, batch, tx, devices: int | dict[str, int], param_dtype: str, specs=None
) -> str:
    """Each stage's compiled peak per device (:func:`zeroshard.step_memory`), on
    ``devices`` simulated devices along the optimizer's axis or on a mesh of that shape
    (Auto axes), the parameters laid out as ``specs`` say (``None``: replicated)."""
    import jax

    import zeroshard as zs

    tx = tx if isinstance(tx, zs.ShardedTransformation) else zs.sharded(tx)
    shape = devices if isinstance(devices, dict) else {tx.axis_name: devices}
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    used = jax.devices()[: math.prod(shape.values())]
    mesh = jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=auto, devices=used)
    if specs is not None:
        named = lambda spec: jax.sharding.NamedSharding(mesh, spec)
        on = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named(spec))
        params = jax.tree.map(on, params, specs)
    lines = [
        "| stage | arguments | temporaries | peak per device (compiled) |",
        "|---:|---:|---:|---:|",
    ]
    for stage in (1, 2, 3):
        try:
            m = zs.step_memory(
                loss_fn, tx, mesh, params, batch, stage=stage, param_dtype=param_dtype
            )
        except (ValueError, TypeError) as e:  # e.g. a loss that does not gather stage 3's pieces
            lines.append(f"| {stage} | - | - | {str(e).splitlines()[0][:120]} |")
            continue
        lines.append(f"| {stage} | {m.arguments:,} | {m.temporaries:,} | {m.peak:,} |")
    return "\n".join(lines)


def _mesh_shape(text: str) -> dict[str, int]:
    """``"data=4,model=2"`` as ``{"data": 4, "model": 2}``."""
    try:
        shape = {name: int(size) for name, size in (a.split("=") for a in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected axis=size,... (data=4,model=2), got {text!r}"
        ) from None
    if not shape or min(shape.values()) < 1:
        raise argparse.ArgumentTypeError(f"every axis needs a positive size, got {text!r}")
    return shape


def _load(spec: str):
    """The object ``module:name`` names (its module imported from the current directory
    or the path)."""
    import importlib

    module, _, name = spec.partition(":")
    sys.path.insert(0, ".")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroshard")
    commands = parser.add_subparsers(dest="command", required=True)
    plan_cmd = commands.add_parser("plan", help="model-state memory per device, by stage")
    plan_cmd.add_argument(
        "--params", required=True, help="a count (7.5e9) or module:function returning the params"
    )
    where = plan_cmd.add_mutually_exclusive_group(required=True)
    where.add_argument("--devices", type=int, help="the device count (along the data axis)")
    where.add_argument(
        "--mesh",
        type=_mesh_shape,
        help="a mesh's shape, e.g. data=4,model=2: as zeroshard's step lays the state on it",
    )
    plan_cmd.add_argument("--loss", help="module:function, the loss (with --batch: the peak)")
    plan_cmd.add_argument("--batch", help="module:function returning the global batch")
    plan_cmd.add_argument("--param-dtype", default="bfloat16")
    plan_cmd.add_argument(
        "--param-specs",
        help="module:function returning the params' PartitionSpecs on the --mesh (their layout)",
    )
    plan_cmd.add_argument(
        "--optimizer",
        default="adam",
        help="adam, sgd, momentum, ...; or module:function returning an optax transformation",
    )
    inspect_cmd = commands.add_parser("inspect", help="print a checkpoint's metadata")
    inspect_cmd.add_argument("directory")
    inspect_cmd.add_argument("--step", type=int, default=None, help="default: the latest")
    inspect_cmd.add_argument("--json", action="store_true", help="print the raw record")
    inspect_cmd.add_argument(
        "--verify", action="store_true", help="read the arrays and check their checksums"
    )
    args = parser.parse_args(argv)
    if args.command == "plan":
        functions = ":" in args.params and ":" in args.optimizer
        if (args.loss is None) != (args.batch is None) or (args.loss and not functions):
            parser.error(
                "--loss and --batch go together, with --params and --optimizer module:function"
            )
        if args.param_specs and not (args.mesh and ":" in args.params):
            parser.error("--param-specs goes with --mesh and --params module:function")
        return plan_command(args)
    return inspect(args)


if __name__ == "__main__":
    sys.exit(main())
