"""A step's logical item, shared by :class:`zeroshard.CheckpointManager` and the orbax
handler of :mod:`zeroshard.checkpointing.handler`: built from a
:class:`zeroshard.TrainState` at save, and, at restore, the target it is read into and
the sharded state rebuilt from what was read.

The item is ``{"step", "params", "opt_state"}`` (and ``"model_state"``) in the
logical layout of :func:`zeroshard.to_optax_state`; the handler adds ``"extra"``
(the other fields of a Flax state). Its leaves are read back split over the axis
where :func:`zeroshard.logical.logical_spec` splits them, so each device reads its
own block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.checkpointing.metadata import check_format, check_matches, saved_loss_scale
from zeroshard.layout import PyTree
from zeroshard.logical import from_optax_state, logical_spec, logical_structs, to_optax_state
from zeroshard.mesh import check_mesh
from zeroshard.sharded import ShardedTransformation, sharding_of
from zeroshard.step import TrainState


def logical_item(state: TrainState, tx: ShardedTransformation) -> dict[str, PyTree]:
    """What a step stores of ``state``: ``{"step", "params", "opt_state"}`` in the
    logical layout, and ``"model_state"`` when the state has one."""
    params, opt_state = to_optax_state(state, tx)
    item = {"step": state.step, "params": params, "opt_state": opt_state}
    if state.model_state is not None:
        item["model_state"] = state.model_state
    return item


def read_target(
    saved: dict[str, Any],
    where: tuple[int, str],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    like: PyTree,
    model_state: PyTree,
) -> dict[str, PyTree]:
    """Checks a step's record against the state to restore and returns the
    ``ShapeDtypeStruct`` tree to read its item into, on ``mesh``.

    Args:
      saved: the step's metadata record (its digest already checked).
      where: ``(step, directory)``, for the messages.
      tx: the optimizer to restore for.
      mesh: the mesh to read onto (any device count).
      like: the parameters' structs in their compute dtypes.
      model_state: the model state's structs, or ``None``.

    Raises:
      ValueError: for another format, a mesh without the optimizer's axis, or a
        checkpoint of another model, optimizer or dtypes (naming the first leaf).
    """
    step, directory = where
    check_mesh(sharding_of(tx).config, mesh, tx.axis_name)
    check_format(saved, step, directory)
    logical = logical_structs(tx.plan(like, mesh.shape[tx.axis_name]), tx)
    check_matches(saved, step, directory, like, logical, model_state)
    replicated = NamedSharding(mesh, P())
    item = {
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        "params": placed(logical[0], mesh, tx.axis_name),
        "opt_state": placed(logical[1], mesh, tx.axis_name),
    }
    if model_state is not None:
        item["model_state"] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), model_state
        )
    return item


def from_item(
    restored: dict[str, PyTree],
    saved: dict[str, Any],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    like: PyTree,
    stage: int = 1,
) -> TrainState:
    """The :class:`zeroshard.TrainState` on ``mesh`` from an item read back (and
    verified): the inverse of :func:`logical_item`, with the skipped-step count and the
    loss scale from the record ``saved``."""
    return from_optax_state(
        restored["params"],
        restored["opt_state"],
        tx,
        mesh,
        axis_name=tx.axis_name,
        param_dtype=jax.tree.map(lambda x: x.dtype, like),
        step=restored["step"],
        stage=stage,
        skipped=saved.get("skipped_steps", 0),
        loss_scale=saved_loss_scale(saved) if tx.config.loss_scale else None,
        model_state=restored.get("model_state"),
    )


def placed(structs: PyTree, mesh: jax.sharding.Mesh, axis_name: str | None = None) -> PyTree:
    """``ShapeDtypeStruct`` of ``structs`` (anything with a shape and a dtype) laid out on
    ``mesh`` as saved: split along ``axis_name`` (default: the mesh's first axis) where
    :func:`zeroshard.logical.logical_spec` splits them."""
    axis = mesh.axis_names[0] if axis_name is None else axis_name
    num = mesh.shape[axis]
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, logical_spec(x.shape, num, axis))
        ),
        structs,
    )
