"""A checkpoint step: its logical item and its metadata record (the record's JSON
schema), built at save and, at restore, checked against the state to restore, read and
laid out again; shared by :class:`zeroshard.CheckpointManager` and the orbax handler of
:mod:`zeroshard.checkpointing.handler`.

The item (:func:`save_item`) is ``{"step", "params", "opt_state"}`` (and
``"model_state"``) in the logical layout of :func:`zeroshard.to_optax_state`; the
handler adds ``"extra"`` (the other fields of a Flax state). Its leaves are read back
split over the axis where :func:`zeroshard.checkpointing.logical.logical_spec` splits them, so each
device reads its own block (:func:`restore_item`; :func:`verify_item` reads them
without the model or optimizer, only to check their checksums).

:class:`zeroshard.CheckpointManager` stores the record as the orbax item ``zeroshard``
of every step, readable without loading arrays (``python -m zeroshard inspect DIR``).
Its fields, in the order they are written (:func:`save_item`):

- ``format`` (:data:`FORMAT`), ``zeroshard_version``, ``jax_version``,
  ``optax_version``, ``saved_at``, ``step``;
- ``skipped_steps`` (non-finite steps skipped) and ``loss_scale`` (``[scale,
  good_steps]`` or ``null``): state that is not in the arrays;
- ``num_shards`` (the devices the state was split over), ``axis_name``,
  ``mesh_shape``: how it was laid out at save (it restores on any device count);
- ``master_dtype``, ``param_tree``, ``param_dtypes`` (the compute dtype of each
  parameter), and ``params``, ``opt_state``, ``model_state``: every logical leaf's
  ``{"shape", "dtype"}`` by path (:func:`zeroshard.checkpointing.logical.describe`);
- with checksums: ``checksums`` (:func:`zeroshard.checkpointing.integrity.record`) and
  ``record_sha256``, the SHA-256 of the rest (:func:`~zeroshard.checkpointing.integrity.digest`).

The ``check_*`` functions raise on a record that does not fit: a damaged record or
leaf (:class:`~zeroshard.CheckpointCorruptedError`), or a checkpoint of another format,
model, optimizer or dtypes (``ValueError``, naming the first differing leaf). Their
messages name the step and the directory, and a corruption message ends as its
:class:`~zeroshard.checkpointing.integrity.Where` says (the other steps to restore
instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.checkpointing.integrity import (
    ALGORITHM,
    RECORD_DIGEST,
    CheckpointCorruptedError,
    Where,
    by_parts,
    digest,
    first_mismatch,
    leaf_count,
    read_or_refuse,
    record,
)
from zeroshard.checkpointing.logical import (
    describe,
    first_difference,
    from_optax_state,
    logical_spec,
    logical_structs,
    to_optax_state,
)
from zeroshard.communication.collectives import mesh_size
from zeroshard.communication.stage3 import full_structs
from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import check_mesh, mesh_of, own_layout
from zeroshard.core.state_layout import state_layout
from zeroshard.optimizer.loss_scale import LossScaleState
from zeroshard.optimizer.sharded import ShardedTransformation, optimizer_of
from zeroshard.training.step import TrainState

logger = logging.getLogger(__name__)

FORMAT = "zeroshard-logical-1"
"""The ``format`` field: the logical layout of :func:`zeroshard.to_optax_state`."""


def check_leaves(what: str, saved: dict, expected: dict, hint: str) -> None:
    """Raises a ``ValueError`` naming the first path where the record's description of
    leaves (:func:`zeroshard.checkpointing.logical.describe`) differs from the state's."""
    found = first_difference(saved, expected)
    if found is not None:
        path, a, b = found
        raise ValueError(
            f"the checkpoint does not match: {what} {path} is {a} in the checkpoint but {b} "
            f"here. {hint}"
        )


def save_item(
    state: TrainState,
    tx: ShardedTransformation,
    *,
    checksums: bool,
    extra: dict[str, PyTree] | None = None,
) -> tuple[dict[str, PyTree], dict[str, Any]]:
    """What a step stores of ``state``, and its record (checksums computed on device,
    now: ``state`` may be donated once this returns).

    Args:
      state: the training state being saved, laid out on its mesh.
      tx: its optimizer.
      checksums: add ``checksums`` of the item and the record's SHA-256.
      extra: the other fields of a Flax state, as stored
        (:mod:`zeroshard.checkpointing.handler`), described as ``extra``.

    Returns:
      ``(item, record)``: the item is ``{"step", "params", "opt_state"}`` in the
      logical layout, with ``"model_state"`` when the state has one and ``"extra"``
      when ``extra`` has leaves.
    """
    from zeroshard import __version__  # (the package imports this module)

    params, opt_state = to_optax_state(state, tx)
    item = {"step": state.step, "params": params, "opt_state": opt_state}
    if state.model_state is not None:
        item["model_state"] = state.model_state
    scale, mesh, compute = state.opt_state.loss_scale, mesh_of(state), full_structs(state.params)
    metadata = {
        "format": FORMAT,
        "zeroshard_version": __version__,
        "jax_version": jax.__version__,
        "optax_version": optax.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step": int(state.step),
        "skipped_steps": int(state.opt_state.skipped),
        "loss_scale": None if scale is None else [float(scale.scale), int(scale.good_steps)],
        "num_shards": mesh_size(mesh, state.opt_state.layout.axes),
        "axis_name": tx.axis_name,
        "mesh_shape": {str(k): int(v) for k, v in mesh.shape.items()},
        "master_dtype": None if tx.config.master_dtype is None else tx.config.master_dtype.name,
        "param_tree": str(jax.tree.structure(compute)),
        "param_dtypes": {k: v["dtype"] for k, v in describe(compute).items()},
        "params": describe(params),
        "opt_state": describe(opt_state),
        "model_state": None if state.model_state is None else describe(state.model_state),
    }
    if extra:
        item["extra"] = extra
        metadata["extra"] = describe(extra)
    if checksums:
        metadata["checksums"] = record(item)
        metadata[RECORD_DIGEST] = digest(metadata)
    return item, metadata


def check_digest(metadata: dict[str, Any], where: Where) -> None:
    """Raises :class:`~zeroshard.CheckpointCorruptedError` if a record read back does
    not match the SHA-256 saved with it (records saved without one pass)."""
    recorded = metadata.get(RECORD_DIGEST)
    if recorded is not None and recorded != digest(metadata):
        raise CheckpointCorruptedError(
            f"{where}: the checkpoint is corrupted. Its metadata record does not match the "
            f"SHA-256 recorded with it. {where.others()}"
        )


def check_matches(
    saved: dict[str, Any],
    where: Where,
    like: PyTree,
    logical: tuple[PyTree, PyTree],
    model_state: PyTree,
) -> None:
    """Raises a ``ValueError`` unless the saved record is of this :data:`FORMAT` and
    describes the state to restore, naming the first leaf where it differs.

    Args:
      saved: the step's record.
      where: the step, for the message.
      like: the parameters' structs in their compute dtypes.
      logical: the structs of the master weights and the inner optimizer's state in
        the logical layout, for the optimizer restored into.
      model_state: the model state's structs, or ``None`` to restore without one.
    """
    if saved.get("format") != FORMAT:
        raise ValueError(f"{where} is not a {FORMAT} checkpoint.")
    params_structs, opt_structs = logical
    hint = "Restore with the model (like=...) and optimizer the checkpoint was saved with."
    saved_compute = {
        path: {"shape": leaf["shape"], "dtype": saved["param_dtypes"].get(path)}
        for path, leaf in saved["params"].items()
    }
    check_leaves("parameter", saved_compute, describe(like), hint)
    check_leaves("master weight", saved["params"], describe(params_structs), hint)
    check_leaves("optimizer state leaf", saved["opt_state"], describe(opt_structs), hint)
    saved_model_state = saved.get("model_state")
    if (saved_model_state is None) != (model_state is None):
        raise ValueError(
            f"{where} was saved {'without' if saved_model_state is None else 'with'} a "
            f"model_state; restore with model_state="
            f"{'None' if saved_model_state is None else 'its tree'}."
        )
    if model_state is not None:
        check_leaves("model state leaf", saved_model_state, describe(model_state), hint)


def check_checksums(saved: dict[str, Any], got: dict[str, Any], where: Where) -> None:
    """Compares checksums recomputed on the arrays read back (``got``, from
    :func:`~zeroshard.checkpointing.integrity.record`) with the recorded ones.

    A record without checksums (saved before they existed) only logs a warning.

    Raises:
      ValueError: if the checksums are of another algorithm.
      CheckpointCorruptedError: naming the first leaf whose checksum differs.
    """
    recorded = saved.get("checksums")
    if recorded is None:
        logger.warning(
            "zeroshard: %s has no checksums (saved by zeroshard %s before they were "
            "recorded): restored without verifying it.",
            where,
            saved.get("zeroshard_version", "< 0.1"),
        )
        return
    if recorded.get("algorithm") != ALGORITHM:
        raise ValueError(
            f"{where} has checksums of kind {recorded.get('algorithm')!r}; this zeroshard "
            f"computes {ALGORITHM!r}. Restore it with the zeroshard version that saved it."
        )
    mismatch = first_mismatch(recorded, got)
    if mismatch is not None:
        leaf, read, want = mismatch
        raise CheckpointCorruptedError(
            f"{where}: the checkpoint is corrupted. The checksum of {leaf} read from disk is "
            f"{read}, but {want} was recorded when it was saved. {where.others()}"
        )


def restore_item(
    saved: dict[str, Any],
    where: Where,
    read: Callable[[dict[str, PyTree]], dict[str, PyTree]],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    like: PyTree,
    *,
    model_state: PyTree = None,
    stage: int = 1,
    extra: dict[str, PyTree] | None = None,
    verify: bool = True,
) -> tuple[TrainState, dict[str, PyTree]]:
    """A step read onto ``mesh`` and laid out as ``tx`` does (the inverse of
    :func:`save_item`): the record is checked against the state to restore, every
    device reads its blocks, the checksums are verified, and the state is rebuilt with
    the skipped-step count and the loss scale from the record.

    Args:
      saved: the step's metadata record (its digest already checked).
      where: the step, for the messages.
      read: reads the item into a tree of ``ShapeDtypeStruct`` (an orbax restore).
      tx: the optimizer to restore for.
      mesh: the mesh to read onto (any device count).
      like: the parameters (arrays, ``Piece`` pieces or ``ShapeDtypeStruct``) in their
        compute dtypes.
      model_state: the model state's tree, or ``None``.
      stage: the ZeRO stage to lay the state out for (3: params as pieces).
      extra: the ``ShapeDtypeStruct`` of the extra leaves to read (the handler's,
        checked against the record's); ``None``: the item has none.
      verify: recompute the checksums of what was read and check them.

    Returns:
      The :class:`zeroshard.TrainState` and the extra leaves read (``{}``: none).

    Raises:
      ValueError: for another format, a mesh without the optimizer's axis, or a
        checkpoint of another model, optimizer, dtypes or extra fields (naming the
        first leaf).
      CheckpointCorruptedError: if a file is unreadable or a leaf's checksum differs.
    """
    given, like, model_state = like, full_structs(like), full_structs(model_state)
    check_mesh(optimizer_of(tx).config, mesh, tx.axis_name)
    built = state_layout(tx, mesh, like, own_layout(given, mesh.axis_names))
    logical = logical_structs(built.plan, built.tx)
    check_matches(saved, where, like, logical, model_state)
    params, opt_state = logical
    item = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": opt_state}
    target = placed(item, mesh, tx.axis_name)  # the step, a scalar, replicated
    if model_state is not None:
        replicated = NamedSharding(mesh, P())
        target["model_state"] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), model_state
        )
    if extra is not None:
        hint = "Restore into a state with the fields the checkpoint was saved with."
        check_leaves("extra leaf", saved.get("extra") or {}, describe(extra), hint)
        if extra:
            target["extra"] = extra
    restored = read_or_refuse(lambda: read(target), where)
    if verify:
        check_checksums(saved, record(restored), where)
    scale = saved.get("loss_scale") if tx.config.loss_scale else None
    if scale is not None:  # recorded as [scale, good_steps]
        scale = LossScaleState(jnp.float32(scale[0]), jnp.int32(scale[1]))
    state = from_optax_state(
        restored["params"],
        restored["opt_state"],
        tx,
        mesh,
        axis_name=tx.axis_name,
        param_dtype=jax.tree.map(lambda x: x.dtype, like),
        step=restored["step"],
        stage=stage,
        skipped=saved.get("skipped_steps", 0),
        loss_scale=scale,
        model_state=restored.get("model_state"),
        param_specs=built.weight_specs,
    )
    return state, restored.get("extra", {})


def verify_item(
    saved: dict[str, Any],
    where: Where,
    read: Callable[[dict[str, PyTree]], dict[str, PyTree]],
    tree: Callable[[], Any],
    mesh: jax.sharding.Mesh | None = None,
) -> int:
    """Reads every array of a step and checks it against the record's checksums,
    without the model or optimizer; returns how many leaves it verified.

    Args:
      saved: the step's metadata record (its digest already checked).
      where: the step, for the messages.
      read: reads the item into a tree of ``ShapeDtypeStruct`` (an orbax restore).
      tree: the item's tree of shapes and dtypes as orbax describes it (called once
        the record is known to have checksums).
      mesh: where to read the arrays; default: a 1-D mesh over all devices.

    Raises:
      ValueError: if the record has no checksums (saved before they were recorded).
      CheckpointCorruptedError: if a leaf differs from its checksum or a file is
        unreadable.
    """
    if saved.get("checksums") is None:
        raise ValueError(
            f"{where} has no checksums (saved by zeroshard {saved.get('zeroshard_version')} "
            "before they were recorded): it cannot be verified."
        )
    if mesh is None:
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
    stored = tree()
    target = placed(getattr(stored, "tree", stored), mesh)  # orbax's metadata, or the tree
    restored = read_or_refuse(lambda: read(target), where)
    recorded = by_parts(saved["checksums"])
    check_checksums({"checksums": recorded}, by_parts(record(restored)), where)
    return leaf_count(recorded)


def placed(structs: PyTree, mesh: jax.sharding.Mesh, axis_name: str | None = None) -> PyTree:
    """``ShapeDtypeStruct`` of ``structs`` (anything with a shape and a dtype) laid out on
    ``mesh`` as saved: split along ``axis_name`` (default: the mesh's first axis) where
    :func:`zeroshard.checkpointing.logical.logical_spec` splits them."""
    axis = mesh.axis_names[0] if axis_name is None else axis_name
    num = mesh_size(mesh, axis)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, logical_spec(x.shape, num, axis))
        ),
        structs,
    )
