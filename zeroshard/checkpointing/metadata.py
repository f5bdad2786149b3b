"""The metadata record of a checkpoint step: its JSON schema, built at save, read and
checked against the state to restore.

:class:`zeroshard.CheckpointManager` stores the record as the orbax item ``zeroshard``
of every step, readable without loading arrays (``python -m zeroshard inspect DIR``).
Its fields, in the order they are written (:func:`build_metadata`):

- ``format`` (:data:`FORMAT`), ``zeroshard_version``, ``jax_version``,
  ``optax_version``, ``saved_at``, ``step``;
- ``skipped_steps`` (non-finite steps skipped) and ``loss_scale`` (``[scale,
  good_steps]`` or ``null``): state that is not in the arrays;
- ``num_shards``, ``axis_name``, ``mesh_shape``: how it was laid out at save (it
  restores on any device count);
- ``master_dtype``, ``param_tree``, ``param_dtypes`` (the compute dtype of each
  parameter), and ``params``, ``opt_state``, ``model_state``: every logical leaf's
  ``{"shape", "dtype"}`` by path (:func:`describe`);
- with checksums: ``checksums`` (:func:`zeroshard.checkpointing.integrity.record`) and
  ``record_sha256``, the SHA-256 of the rest (:func:`~zeroshard.checkpointing.integrity.digest`).

The ``check_*`` functions raise on a record that does not fit: a damaged record or
leaf (:class:`~zeroshard.CheckpointCorruptedError`), or a checkpoint of another format,
model, optimizer or dtypes (``ValueError``, naming the first differing leaf). Their
messages name the step and the directory; ``others`` words the last sentence of a
corruption message (the other steps to restore instead) and is called only then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zeroshard.checkpointing.integrity import (
    ALGORITHM,
    RECORD_DIGEST,
    CheckpointCorruptedError,
    digest,
    first_mismatch,
    record,
)
from zeroshard.layout import PyTree
from zeroshard.loss_scale import LossScaleState
from zeroshard.sharded import ShardedTransformation
from zeroshard.stage3 import full_structs
from zeroshard.step import TrainState

logger = logging.getLogger(__name__)

FORMAT = "zeroshard-logical-1"
"""The ``format`` field: the logical layout of :func:`zeroshard.to_optax_state`."""


def describe(tree: PyTree) -> dict[str, dict[str, Any]]:
    """Every leaf of ``tree`` as ``{keystr(path): {"shape": [...], "dtype": name}}``."""
    return {
        jax.tree_util.keystr(path): {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def first_difference(what: str, saved: dict, expected: dict, hint: str) -> None:
    """Raises a ``ValueError`` naming the first path where two descriptions differ."""
    for path in dict.fromkeys([*saved, *expected]):
        a, b = saved.get(path), expected.get(path)
        if a != b:

            def show(d):
                return "missing" if d is None else f"{d['dtype']}{d['shape']}"

            raise ValueError(
                f"the checkpoint does not match: {what} {path} is {show(a)} in the "
                f"checkpoint but {show(b)} here. {hint}"
            )


def build_metadata(
    state: TrainState,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    item: dict[str, Any],
    *,
    checksums: bool,
) -> dict[str, Any]:
    """The record of a step saved from ``state``.

    Args:
      state: the training state being saved, laid out on ``mesh``.
      tx: its optimizer.
      mesh: the mesh ``state`` lives on.
      item: what is written as the ``state`` item: ``{"step", "params", "opt_state"}``
        in the logical layout (and ``"model_state"``, when the state has one;
        ``"extra"``, described as ``extra``, for the other fields of a Flax state).
      checksums: add ``checksums`` of ``item`` and the record's SHA-256.
    """
    scale = state.opt_state.loss_scale
    metadata = {
        "format": FORMAT,
        "zeroshard_version": _version(),
        "jax_version": jax.__version__,
        "optax_version": optax.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step": int(state.step),
        "skipped_steps": int(state.opt_state.skipped),
        "loss_scale": None if scale is None else [float(scale.scale), int(scale.good_steps)],
        "num_shards": mesh.shape[tx.axis_name],
        "axis_name": tx.axis_name,
        "mesh_shape": {str(k): int(v) for k, v in mesh.shape.items()},
        "master_dtype": None if tx.config.master_dtype is None else tx.config.master_dtype.name,
        "param_tree": str(jax.tree.structure(full_structs(state.params))),
        "param_dtypes": {k: v["dtype"] for k, v in describe(full_structs(state.params)).items()},
        "params": describe(item["params"]),
        "opt_state": describe(item["opt_state"]),
        "model_state": None if state.model_state is None else describe(state.model_state),
    }
    if "extra" in item:  # the other fields of a Flax state (zeroshard.checkpointing.handler)
        metadata["extra"] = describe(item["extra"])
    if checksums:
        metadata["checksums"] = record(item)
        metadata[RECORD_DIGEST] = digest(metadata)
    return metadata


def check_digest(
    metadata: dict[str, Any], step: int, directory: str, others: Callable[[], str]
) -> None:
    """Raises :class:`~zeroshard.CheckpointCorruptedError` if a record read back does
    not match the SHA-256 saved with it (records saved without one pass)."""
    recorded = metadata.get(RECORD_DIGEST)
    if recorded is not None and recorded != digest(metadata):
        raise CheckpointCorruptedError(
            f"step {step} of {directory}: the checkpoint is corrupted. Its metadata "
            "record does not match the SHA-256 recorded with it. "
            f"{others()}"
        )


def check_format(saved: dict[str, Any], step: int, directory: str) -> None:
    """Raises a ``ValueError`` unless the record is of this :data:`FORMAT`."""
    if saved.get("format") != FORMAT:
        raise ValueError(f"{directory} step {step} is not a {FORMAT} checkpoint.")


def check_matches(
    saved: dict[str, Any],
    step: int,
    directory: str,
    like: PyTree,
    logical: tuple[PyTree, PyTree],
    model_state: PyTree,
) -> None:
    """Raises a ``ValueError`` naming the first leaf where the saved record differs
    from the state to restore.

    Args:
      saved: the step's record.
      step, directory: where it is, for the message.
      like: the parameters' structs in their compute dtypes.
      logical: the structs of the master weights and the inner optimizer's state in
        the logical layout, for the optimizer restored into.
      model_state: the model state's structs, or ``None`` to restore without one.
    """
    params_structs, opt_structs = logical
    hint = "Restore with the model (like=...) and optimizer the checkpoint was saved with."
    saved_compute = {
        path: {"shape": leaf["shape"], "dtype": saved["param_dtypes"].get(path)}
        for path, leaf in saved["params"].items()
    }
    first_difference("parameter", saved_compute, describe(like), hint)
    first_difference("master weight", saved["params"], describe(params_structs), hint)
    first_difference("optimizer state leaf", saved["opt_state"], describe(opt_structs), hint)
    saved_model_state = saved.get("model_state")
    if (saved_model_state is None) != (model_state is None):
        raise ValueError(
            f"step {step} of {directory} was saved "
            f"{'without' if saved_model_state is None else 'with'} a model_state; restore "
            f"with model_state={'None' if saved_model_state is None else 'its tree'}."
        )
    if model_state is not None:
        first_difference("model state leaf", saved_model_state, describe(model_state), hint)


def check_checksums(
    saved: dict[str, Any],
    got: dict[str, Any],
    step: int,
    directory: str,
    others: Callable[[], str],
) -> None:
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
            "zeroshard: step %d of %s has no checksums (saved by zeroshard %s before they "
            "were recorded): restored without verifying it.",
            step,
            directory,
            saved.get("zeroshard_version", "< 0.1"),
        )
        return
    if recorded.get("algorithm") != ALGORITHM:
        raise ValueError(
            f"step {step} of {directory} has checksums of kind "
            f"{recorded.get('algorithm')!r}; this zeroshard computes {ALGORITHM!r}. "
            "Restore it with the zeroshard version that saved it."
        )
    mismatch = first_mismatch(recorded, got)
    if mismatch is not None:
        leaf, read, want = mismatch
        raise CheckpointCorruptedError(
            f"step {step} of {directory}: the checkpoint is corrupted. The "
            f"checksum of {leaf} read from disk is {read}, but {want} was recorded "
            f"when it was saved. {others()}"
        )


def require_checksums(saved: dict[str, Any], step: int, directory: str) -> None:
    """Raises a ``ValueError`` if the record has no checksums to verify against."""
    if saved.get("checksums") is None:
        raise ValueError(
            f"step {step} of {directory} has no checksums (saved by zeroshard "
            f"{saved.get('zeroshard_version')} before they were recorded): it cannot "
            "be verified."
        )


def saved_loss_scale(saved: dict[str, Any]) -> LossScaleState | None:
    """The loss scale's state from the record (``[scale, good_steps]``), or ``None``."""
    scale = saved.get("loss_scale")
    if scale is None:
        return None
    return LossScaleState(jnp.float32(scale[0]), jnp.int32(scale[1]))


def _version() -> str:
    from zeroshard import __version__

    return __version__
