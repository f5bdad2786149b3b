"""The checkpoint manager: save, restore and verify a ``TrainState`` with orbax, in the
logical layout, and the lifecycle of orbax's manager (async saves, ``max_to_keep``).

On disk a step holds two orbax items:

- ``state``: ``{"step", "params", "opt_state"}`` (and ``"model_state"``, replicated,
  when the state has one) in the logical layout of
  :func:`zeroshard.to_optax_state`: the parameters in the master dtype and the inner
  optimizer's state shaped exactly as plain optax's. Nothing in it depends on the
  device count, and a plain optax user can restore it with
  ``ocp.args.StandardRestore(target)`` where ``target`` is ``{"step", "params",
  "opt_state"}`` for their own ``inner.init(params)``. Each device writes its own
  block of every leaf that has a dimension divisible by the device count (see
  :mod:`zeroshard.checkpointing.logical`); only leaves with none are written from one copy.
- ``zeroshard``: JSON metadata (library version, device count and axis at save time,
  compute and master dtypes, every leaf's path and shape, the count of skipped
  non-finite steps, the loss scale, and every logical leaf's checksum), readable
  without loading arrays: ``python -m zeroshard inspect DIR``. Its schema, and the
  checks of a saved record against the state to restore:
  :mod:`zeroshard.checkpointing.metadata`.

orbax does not verify what it reads: damaged bytes can restore as wrong values
without an error. So :meth:`CheckpointManager.save` records a checksum of every
logical leaf (:mod:`zeroshard.checkpointing.integrity`: computed on device, the same on
any device count), and :meth:`CheckpointManager.restore` recomputes them on the
restored arrays and raises :class:`~zeroshard.CheckpointCorruptedError` on a mismatch.
``step="latest_valid"`` restores the newest step that verifies, saying which it
skipped; ``python -m zeroshard inspect DIR --verify`` checks a step without training
code. Steps saved before checksums existed restore with a warning that they were not
verified. Warnings are records of the ``zeroshard.checkpointing`` loggers (on stderr
unless logging is configured otherwise).

orbax's ``CheckpointManager`` provides async saves, ``max_to_keep`` and atomic
finalisation: a step appears only once fully written, so a process killed while
saving leaves the previous steps intact.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
from typing import Any, Literal

import jax

from zeroshard.checkpointing.integrity import CheckpointCorruptedError, Where, read_or_refuse
from zeroshard.checkpointing.metadata import check_digest, restore_item, save_item, verify_item
from zeroshard.core.layout import PyTree
from zeroshard.optimizer.sharded import ShardedTransformation
from zeroshard.training.step import TrainState

logger = logging.getLogger(__name__)

STATE_ITEM = "state"
METADATA_ITEM = "zeroshard"
LATEST_VALID = "latest_valid"


class CheckpointManager:
    """Saves and restores :class:`zeroshard.TrainState` with orbax, on any device count.

    Args:
      directory: where the steps live (created on the first save).
      tx: the optimizer from :func:`zeroshard.sharded` the states belong to; only
        :meth:`metadata`, :meth:`all_steps` and :meth:`latest_step` work without it.
      max_to_keep: how many finalised steps to keep (``None``: all).
      async_save: write in a background thread; :meth:`save` returns once the arrays
        are copied off the devices, so the state can be donated right after.
      checksums: record every logical leaf's checksum at save and verify them at
        restore (the default). ``False`` skips both, e.g. to measure their cost.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax, zeroshard as zs
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = zs.sharded(optax.adam(1e-3), axis_name="data")
      >>> params = {"w": jnp.ones((8, 3))}
      >>> state = zs.init_train_state(params, tx, mesh)
      >>> with zs.CheckpointManager(tempfile.mkdtemp(), tx) as ckpt:
      ...     ckpt.save(state)
      ...     ckpt.wait_until_finished()
      ...     restored = ckpt.restore(mesh, like=params)
      True
      >>> restored.params["w"].shape, int(restored.step)
      ((8, 3), 0)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        tx: ShardedTransformation | None = None,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        checksums: bool = True,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.tx = tx
        self._options = {"max_to_keep": max_to_keep, "enable_async_checkpointing": async_save}
        self._checksums = checksums
        self._manager = None

    def _orbax(self, create: bool = False):
        import orbax.checkpoint as ocp

        if self._manager is None:  # callers check the directory first (_resolve)
            options = ocp.CheckpointManagerOptions(**self._options, create=create)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def _require_tx(self) -> ShardedTransformation:
        if self.tx is None:
            raise ValueError("pass the optimizer: zs.CheckpointManager(directory, tx).")
        return self.tx

    def all_steps(self) -> list[int]:
        """The finalised steps on disk, oldest first (``[]`` if there are none)."""
        if self._manager is None and not os.path.isdir(self.directory):
            return []
        return sorted(self._orbax().all_steps())

    def latest_step(self) -> int | None:
        """The newest finalised step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> int:
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoint directory at {self.directory}")
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no finalised checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"no step {step} in {self.directory}; saved steps: {steps}")
        return step

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata record of ``step`` (default: the latest), without loading arrays.

        Raises:
          FileNotFoundError: if there is no directory or no finalised step in it.
          CheckpointCorruptedError: if the record is unreadable or does not match the
            SHA-256 saved with it.
        """
        import orbax.checkpoint as ocp

        step = self._resolve(step)
        args = ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
        read = lambda: self._orbax().restore(step, args=args)[METADATA_ITEM]
        where = self._where(step)
        meta = dict(read_or_refuse(read, where, "the metadata record of "))
        check_digest(meta, where)
        return meta

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        """Saves ``state`` as step ``state.step`` (asynchronously by default).

        Args:
          state: the training state; it may be donated as soon as this returns.
          force: save even if orbax's save policy would skip this step.

        Returns:
          Whether a save was started.

        Raises:
          ValueError: if this step is already saved (nothing is overwritten).
        """
        import orbax.checkpoint as ocp

        tx = self._require_tx()
        step = int(state.step)
        # (orbax's manager is made here on every process alike: whether the directory
        # exists yet is a race between processes, one of which creates it, and
        # managers made with and without `create` wait at different barriers)
        manager = self._orbax(create=True)
        if step in manager.all_steps():
            raise ValueError(
                f"step {step} is already saved in {self.directory}; nothing was overwritten."
            )
        item, metadata = save_item(state, tx, checksums=self._checksums)
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(item), METADATA_ITEM: ocp.args.JsonSave(metadata)}
        )
        return manager.save(step, args=args, force=force)

    def restore(
        self,
        mesh: jax.sharding.Mesh,
        like: PyTree,
        *,
        step: int | Literal["latest_valid"] | None = None,
        stage: int = 1,
        model_state: PyTree = None,
    ) -> TrainState:
        """Restores a step onto ``mesh``, whatever the device count and stage it was saved
        with, and verifies every leaf against the checksum recorded at save.

        Args:
          mesh: the mesh to lay the state out on; it must have the optimizer's axis.
          like: the parameters (arrays or ``jax.ShapeDtypeStruct``) in their compute
            dtypes: the tree structure, shapes and dtypes to restore into; at stages
            1 and 2, the layout of the restored weights over the mesh's axes the
            batch is not split over (tensor parallelism), where they have one.
          step: the step to restore: ``None`` (default) for the latest, whether it
            verifies or not; ``"latest_valid"`` for the newest step that verifies
            (each corrupted newer step is named in a logged warning); or a step number.
          stage: the ZeRO stage to lay the state out for (3: params as pieces).
          model_state: the non-trainable model state's tree (arrays or
            ``jax.ShapeDtypeStruct``), when the state was saved with one.

        Returns:
          The :class:`zeroshard.TrainState`, laid out as the train step returns it.

        Raises:
          FileNotFoundError: if there is no directory or no finalised step in it.
          CheckpointCorruptedError: (a ``ValueError``) if a leaf's checksum differs
            from the one recorded at save, or a file is unreadable; the message
            names the step and the leaf and lists the other steps. With
            ``"latest_valid"``, only when no step verifies.
          ValueError: if the checkpoint is of another model or optimizer, or in other
            dtypes (naming the first differing leaf). Nothing on disk is changed.
        """
        if step != LATEST_VALID:
            return self._restore(mesh, like, self._resolve(step), stage, model_state)
        self._resolve(None)  # raises the error that says why there is no step
        errors = []
        for candidate in reversed(self.all_steps()):
            try:
                state = self._restore(mesh, like, candidate, stage, model_state)
            except CheckpointCorruptedError as e:
                errors.append(e)
                continue
            if errors:
                logger.warning(
                    "zeroshard: restored step %d, the newest step of %s that verifies; skipped: %s",
                    candidate,
                    self.directory,
                    " | ".join(map(str, errors)),
                )
            return state
        raise CheckpointCorruptedError(
            f"no step of {self.directory} verifies: " + " | ".join(map(str, errors))
        )

    def _restore(
        self, mesh: jax.sharding.Mesh, like: PyTree, step: int, stage: int, model_state: PyTree
    ) -> TrainState:
        tx = self._require_tx()
        saved, read = self.metadata(step), functools.partial(self._read, step)
        options = {"model_state": model_state, "stage": stage, "verify": self._checksums}
        return restore_item(saved, self._where(step), read, tx, mesh, like, **options)[0]

    def _read(self, step: int, target: PyTree) -> PyTree:
        """The ``state`` item of ``step`` read into ``target``."""
        import orbax.checkpoint as ocp

        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target)})
        return self._orbax().restore(step, args=args)[STATE_ITEM]

    def _where(self, step: int) -> Where:
        """``step``, for messages: a corruption message ends naming the other steps."""

        def others() -> str:
            steps = [s for s in self.all_steps() if s != step]
            return (
                f"Nothing on disk was changed. Other steps: {steps}; restore one with "
                f"step=K, or step={LATEST_VALID!r} for the newest step that verifies."
            )

        return Where(self.directory, step, others)

    def verify(self, step: int | None = None, mesh: jax.sharding.Mesh | None = None) -> int:
        """Reads every array of a step and checks it against the recorded checksums,
        without the model or optimizer (what ``python -m zeroshard inspect --verify``
        runs).

        Args:
          step: the step to check (default: the latest).
          mesh: where to read the arrays; default: a 1-D mesh over all devices.

        Returns:
          The number of leaves verified.

        Raises:
          FileNotFoundError: if there is no directory or no finalised step in it.
          CheckpointCorruptedError: if a leaf differs from its checksum or a file is
            unreadable (nothing on disk is changed).
          ValueError: if the step has no checksums (saved before they were recorded).
        """
        import orbax.checkpoint as ocp

        step = self._resolve(step)
        path = pathlib.Path(self.directory) / str(step) / STATE_ITEM
        tree = lambda: ocp.StandardCheckpointHandler().metadata(path)
        read = functools.partial(self._read, step)
        return verify_item(self.metadata(step), self._where(step), read, tree, mesh)

    def wait_until_finished(self) -> None:
        """Blocks until an async save in flight is finalised."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
