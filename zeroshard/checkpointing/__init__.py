"""Checkpoints of a ``TrainState`` in the logical, device-count-independent layout.

- :mod:`~zeroshard.checkpointing.manager`: :class:`CheckpointManager`, saving, restoring
  and verifying steps with orbax (async saves, ``max_to_keep``,
  ``step="latest_valid"``).
- :mod:`~zeroshard.checkpointing.metadata`: a step's logical item and its JSON metadata
  record (the record's schema), built at save, and at restore the checks of a saved
  record against the state to restore and the state read and laid out again (shared by
  the manager and the handler).
- :mod:`~zeroshard.checkpointing.integrity`: :func:`checksums` of logical leaves, computed
  on device and the same on any device count; the checksum record and the record's
  SHA-256; :class:`CheckpointCorruptedError`.
- :mod:`~zeroshard.checkpointing.handler`: :class:`ShardedSave` and
  :class:`ShardedRestore`, orbax ``CheckpointArgs`` that save a zeroshard, Linen or NNX
  state as an item of the user's own ``ocp.CheckpointManager`` (imported on first use:
  orbax stays optional), with :mod:`~zeroshard.checkpointing.states`.
"""

from zeroshard.checkpointing.integrity import CheckpointCorruptedError, checksums
from zeroshard.checkpointing.manager import CheckpointManager

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointManager",
    "ShardedCheckpointHandler",
    "ShardedRestore",
    "ShardedSave",
    "checksums",
]


def __getattr__(name: str):
    """The orbax handler's names, imported on first use (they need orbax)."""
    if name in ("ShardedCheckpointHandler", "ShardedRestore", "ShardedSave"):
        from zeroshard.checkpointing import handler

        return getattr(handler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
