"""Checks: the validators every entry point runs at trace time, with the fix in the message.

The mesh has the optimizer's axes and they are named consistently; the stage is one of
1, 2, 3; the batch splits evenly over the devices (and micro-batches); this jax can
lower the step on the mesh's axis types; and the sharding axis is bound where an
update runs.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.config import ShardConfig
from zeroshard.layout import PyTree


def check_mesh(config: ShardConfig, mesh: jax.sharding.Mesh, axis_name: str | None) -> str:
    """The data-parallel axis: ``axis_name``, or the optimizer's when ``None`` (so it is
    said once, in ``zs.sharded``). Refuses a mesh without the optimizer's axes, or an
    ``axis_name`` that is not the optimizer's, naming the fix."""
    axis_name = config.axis_name if axis_name is None else axis_name
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"mesh has no axis {axis_name!r} (its axes: {tuple(mesh.axis_names)}); pass "
            f"axis_name= one of them, or build the mesh with jax.make_mesh((n,), "
            f"({axis_name!r},))."
        )
    if config.axis_name != axis_name:
        raise ValueError(
            f"the optimizer was built with axis_name={config.axis_name!r} but the step uses "
            f"axis_name={axis_name!r}; use the same axis for both."
        )
    if config.replica_axis is not None and config.replica_axis not in mesh.axis_names:
        raise ValueError(
            f"the optimizer replicates over replica_axis={config.replica_axis!r}, but the mesh "
            f"has no such axis (its axes: {tuple(mesh.axis_names)})."
        )
    return axis_name


def check_other_axes(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> None:
    """Refuses, with the fix, a mesh whose other Explicit axes this jax cannot lower a
    reduce-scatter next to (jax 0.12.0.1 fails to lower it); probed, not assumed."""
    explicit = [
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if a not in axes and t == jax.sharding.AxisType.Explicit
    ]
    if not explicit:
        return
    n = math.prod(mesh.shape[a] for a in axes)
    probe = jax.shard_map(
        lambda x: jax.lax.psum_scatter(x, axes, tiled=True),
        mesh=mesh,
        in_specs=P(axes),
        out_specs=P(axes),
        axis_names=set(axes),
    )
    try:
        x = jax.ShapeDtypeStruct((n * n,), jnp.float32, sharding=NamedSharding(mesh, P(axes)))
        jax.jit(probe).lower(x)
    except ValueError as e:
        types = ", ".join(
            "AxisType.Auto" if a in explicit else f"AxisType.{t.name}"
            for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        )
        raise ValueError(
            f"mesh axes {explicit} are AxisType.Explicit, and jax {jax.__version__} cannot "
            f"lower a reduce-scatter over {axes} inside shard_map while another axis is "
            "Explicit. Make the other axes Auto: jax.make_mesh(shape, names, "
            f"axis_types=({types}))."
        ) from e


def check_stage(stage: int) -> None:
    """Refuses a ZeRO stage other than 1, 2 or 3."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}.")


def check_batch(
    batch: PyTree, num_shards: int, axis_name: str | tuple[str, ...], accum_steps: int = 1
) -> None:
    """Refuses an empty batch, or one whose leading dimension does not split evenly over
    ``num_shards`` devices (times ``accum_steps`` micro-batches)."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("the batch is empty: pass a pytree of arrays with a batch dimension.")
    parts = num_shards * accum_steps
    noun = "axes" if isinstance(axis_name, tuple) else "axis"
    what = f"the {num_shards} devices of {noun} {axis_name!r}"
    if accum_steps > 1:
        what += f" times accum_steps={accum_steps}"
    for path, x in leaves:
        shape = jnp.shape(x)
        if not shape or shape[0] % parts:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}: its leading "
                f"(global batch) dimension must be divisible by {what}. Use a global "
                f"batch size that is a multiple of {parts}."
            )


def bound_axis_size(axis_name: str) -> int | None:
    """Size of ``axis_name`` if it is bound here (inside ``shard_map``), else ``None``."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        return None


def find_mesh(config: ShardConfig, tree: PyTree = None) -> Any:
    """The mesh an update outside ``shard_map`` runs on: ``config.mesh``, else the mesh
    set with ``jax.set_mesh``, else the mesh the arrays of ``tree`` are laid out on.

    Raises:
      ValueError: if none of them has ``config.axis_name``, naming the fixes.
    """
    axis = config.axis_name
    if config.mesh is not None:
        return config.mesh
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and axis in context.axis_names:
        return context
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):  # a tracer: its type's sharding
            sharding = getattr(jax.typeof(leaf), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty and axis in mesh.axis_names:
            return mesh
    raise ValueError(
        f"zeroshard: no mesh with axis {axis!r} is known here. Build the optimizer with "
        f"zs.sharded(inner, axis_name={axis!r}, mesh=mesh), or call under "
        "`with jax.set_mesh(mesh):`; inside jax.shard_map over the axis, the local "
        f"update runs. (Mesh set now: {tuple(context.axis_names) or 'none'}.)"
    )
