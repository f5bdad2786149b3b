"""zeroshard's states as an item of the user's own orbax ``CheckpointManager``.

:class:`ShardedSave` and :class:`ShardedRestore` are orbax ``CheckpointArgs``,
registered with :class:`ShardedCheckpointHandler`: pass them in ``ocp.args.Composite``
next to the other items of a step (a JSON config, a dataset iterator, ...), with
orbax's own manager, sync or async. The states they take
(:mod:`zeroshard.checkpointing.states`): a :class:`zeroshard.TrainState`, a Flax Linen
``TrainState`` made with ``tx=zs.sharded(...)`` (a subclass's extra fields too), or an
NNX ``(model, optimizer)`` pair.

The item is an ordinary orbax pytree checkpoint in the logical layout (see
:func:`zeroshard.checkpointing.metadata.save_item`): ``{"step", "params",
"opt_state"}`` as plain optax would hold them (master-dtype parameters, the inner
optimizer's state), and ``"extra"`` for the other fields, so it restores on any
device count, and a plain optax user can read it with ``ocp.args.StandardRestore``.
The metadata record of :mod:`zeroshard.checkpointing.metadata` (the skipped-step
count, the loss scale, every leaf's shape and checksum, the record's SHA-256) is the
item's orbax custom metadata. Restoring checks the record against the target (another
model or optimizer is a ``ValueError`` naming the first differing leaf), reads each
device's block onto the target's mesh, verifies every checksum
(:class:`~zeroshard.CheckpointCorruptedError` naming the leaf), and lays the state out
as the optimizer does. A failed restore changes nothing, on disk or in the target.

Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    >>> import zeroshard as zs
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zs.sharded(optax.adam(1e-3), axis_name="data")
    >>> state = zs.init_train_state({"w": jnp.ones((8, 3))}, tx, mesh)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...     _ = mngr.save(0, args=ocp.args.Composite(
    ...         train_state=zs.ShardedSave(state, tx),
    ...         config=ocp.args.JsonSave({"lr": 1e-3})))
    ...     mngr.wait_until_finished()
    ...     restored = mngr.restore(0, args=ocp.args.Composite(
    ...         train_state=zs.ShardedRestore(state, tx, mesh)))
    >>> restored.train_state.params["w"].shape
    (8, 3)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from zeroshard.checkpointing.integrity import Where, read_or_refuse
from zeroshard.checkpointing.metadata import check_digest, restore_item, save_item
from zeroshard.checkpointing.states import parts_of, rebuilt, target_parts
from zeroshard.optimizer.sharded import ShardedTransformation

RECORD_KEY = "zeroshard"
"""The key of the metadata record in the item's orbax custom metadata."""


def _custom_metadata(impl: Any, directory: epath.Path) -> Any:
    """The item's orbax custom metadata, read from orbax's ``_METADATA`` file without
    opening the arrays (so a damaged data file is found by the checksums, naming the
    leaf); through orbax's metadata call where that file is named otherwise."""
    path = directory / "_METADATA"
    if path.exists():
        return json.loads(path.read_text()).get("custom_metadata")
    return impl.metadata(directory).custom_metadata


def _where(directory: Any, step: int | None = None) -> Where:
    return Where(str(directory), step, lambda: "Nothing on disk was changed.")


class ShardedCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves and restores a zeroshard state as one item of an orbax checkpoint.

    orbax builds it when it meets :class:`ShardedSave` or :class:`ShardedRestore` in
    ``ocp.args.Composite``; it writes through orbax's ``StandardCheckpointHandler``
    (asynchronously when the manager is async).
    """

    def __init__(self) -> None:
        self._impl = ocp.StandardCheckpointHandler()

    def _standard(self, args: ShardedSave) -> ocp.args.StandardSave:
        """orbax's save args for ``args.state``: its logical item, with its metadata
        record as their custom metadata (checksums computed on device, now: the state
        may be donated once this returns)."""
        state, extra, tx = parts_of(args.state, args.tx)
        item, metadata = save_item(state, tx, checksums=args.checksums, extra=extra)
        return ocp.args.StandardSave(item, custom_metadata={RECORD_KEY: metadata})

    async def async_save(self, directory: Any, args: ShardedSave) -> Any:
        """Starts writing ``args.state``; returns orbax's commit futures."""
        return await self._impl.async_save(directory, args=self._standard(args))

    def save(self, directory: epath.Path, args: ShardedSave) -> None:
        """Writes ``args.state`` and waits until it is written."""
        self._impl.save(directory, args=self._standard(args))

    def metadata(self, directory: epath.Path) -> dict[str, Any]:
        """The item's metadata record (checked against its SHA-256), without arrays.

        Raises:
          CheckpointCorruptedError: if it is unreadable or does not match its SHA-256.
          ValueError: if the item was not saved by this handler.
        """
        read = lambda: _custom_metadata(self._impl, epath.Path(directory))
        custom = read_or_refuse(read, _where(directory), "the metadata of ")
        if not isinstance(custom, dict) or RECORD_KEY not in custom:
            raise ValueError(
                f"{directory} was not saved with zs.ShardedSave (no zeroshard "
                "record in its metadata); restore it with ocp.args.StandardRestore."
            )
        saved = dict(custom[RECORD_KEY])
        check_digest(saved, _where(directory, saved.get("step")))
        return saved

    def restore(self, directory: epath.Path, args: ShardedRestore | None = None) -> Any:
        """The state saved in ``directory``, laid out on the target's mesh.

        Raises:
          CheckpointCorruptedError: if a leaf's checksum differs from the one recorded
            at save (naming it), or a file is unreadable.
          ValueError: if the checkpoint is of another model, optimizer, dtypes or
            extra fields than the target (naming the first differing leaf).
        """
        if args is None:
            raise ValueError(
                "restore a zeroshard item with args=ocp.args.Composite(name="
                "zs.ShardedRestore(target, tx, mesh))."
            )
        saved = self.metadata(directory)
        (state, extra, tx), mesh, stage = target_parts(args.target, args.tx, args.mesh)
        read = lambda target: self._impl.restore(directory, args=ocp.args.StandardRestore(target))
        where = _where(directory, saved.get("step"))
        options = {"model_state": state.model_state, "stage": stage, "extra": extra}
        state, extra = restore_item(saved, where, read, tx, mesh, state.params, **options)
        return rebuilt(args.target, state, extra)

    def finalize(self, directory: epath.Path) -> None:
        self._impl.finalize(directory)

    def close(self) -> None:
        self._impl.close()


@ocp.args.register_with_handler(ShardedCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ShardedSave(ocp.args.CheckpointArgs):
    """Saves a zeroshard state as an item of an orbax checkpoint.

    Attributes:
      state: a :class:`zeroshard.TrainState`, a Flax Linen ``TrainState`` made with
        ``tx=zs.sharded(...)``, or an NNX ``(model, optimizer)`` pair.
      tx: the optimizer from :func:`zeroshard.sharded`; default: the state's own
        (``state.tx``, ``optimizer.tx``). Required for a :class:`zeroshard.TrainState`.
      checksums: record every logical leaf's checksum (verified at restore).
    """

    state: Any
    tx: ShardedTransformation | None = None
    checksums: bool = True


@ocp.args.register_with_handler(ShardedCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ShardedRestore(ocp.args.CheckpointArgs):
    """Restores a zeroshard state saved with :class:`ShardedSave`, on any device count.

    Attributes:
      target: a state of the same kind, built for the mesh to restore onto (arrays or
        ``jax.ShapeDtypeStruct``): its tree, shapes and dtypes are what is restored. An
        NNX ``(model, optimizer)`` pair is updated in place and returned.
      tx: the optimizer for the new mesh; default: the target's own.
      mesh: the mesh to restore onto; default: the optimizer's ``mesh=``, else the
        target's.
    """

    target: Any
    tx: ShardedTransformation | None = None
    mesh: jax.sharding.Mesh | None = None
