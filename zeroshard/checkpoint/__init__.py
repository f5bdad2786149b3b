"""Checkpoints of a ``TrainState`` in the logical, device-count-independent layout.

- :mod:`~zeroshard.checkpoint.manager`: :class:`CheckpointManager`, saving, restoring
  and verifying steps with orbax (async saves, ``max_to_keep``,
  ``step="latest_valid"``).
- :mod:`~zeroshard.checkpoint.metadata`: the JSON metadata record of a step: its
  schema, built at save, and the checks of a saved record against the state to
  restore.
- :mod:`~zeroshard.checkpoint.integrity`: :func:`checksums` of logical leaves, computed
  on device and the same on any device count; the checksum record and the record's
  SHA-256; :class:`CheckpointCorruptedError`.
"""

from zeroshard.checkpoint.integrity import CheckpointCorruptedError, checksums
from zeroshard.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointCorruptedError", "CheckpointManager", "checksums"]
