"""zeroshard: ZeRO for JAX — optimizer state and master weights sharded over data-parallel devices.

The package's folders follow the data flow: :mod:`~zeroshard.optimizer` (``zs.sharded``,
its options and state), :mod:`~zeroshard.core` (each leaf's layout and placement, the one
update flow), :mod:`~zeroshard.communication` (how gradients arrive and weights leave:
reduce-scatter, all-gather, quantized codes, the fixed order, stage 3's gathers),
:mod:`~zeroshard.training` (zeroshard's own step, its micro-batches, preemption),
:mod:`~zeroshard.checkpointing` (orbax checkpoints of the logical state),
:mod:`~zeroshard.analysis` (what the traced update reads) and
:mod:`~zeroshard.measuring` (bytes per device, collectives, the planner);
:mod:`zeroshard.flax` integrates Flax NNX and Linen.
"""

from importlib import metadata as _metadata

from zeroshard.analysis import NotElementwiseError
from zeroshard.checkpointing import CheckpointCorruptedError, CheckpointManager, checksums
from zeroshard.checkpointing.logical import from_optax_state, to_optax_state
from zeroshard.communication.stage3 import Piece, gather, layer, layers
from zeroshard.measuring.instruments import (
    Collective,
    collective_dtypes,
    compiled_collectives,
    lowered_collectives,
    state_bytes_per_device,
    summarize,
)
from zeroshard.measuring.memory import MemoryEstimate, StepMemory, estimate_memory, step_memory
from zeroshard.optimizer.clipping import ClipByGlobalNormState, clip_by_global_norm, global_norm
from zeroshard.optimizer.config import ShardConfig
from zeroshard.optimizer.loss_scale import DynamicLossScale, LossScaleState
from zeroshard.optimizer.sharded import ShardedState, ShardedTransformation, sharded
from zeroshard.training.peers import PeerWatchdog
from zeroshard.training.preemption import PreemptionGuard
from zeroshard.training.step import TrainState, TrainStep, init_train_state, make_train_step

try:  # The one source of the version is pyproject.toml, read from the installed metadata.
    __version__ = _metadata.version("zeroshard")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointManager",
    "ClipByGlobalNormState",
    "Collective",
    "DynamicLossScale",
    "LossScaleState",
    "MemoryEstimate",
    "NotElementwiseError",
    "PeerWatchdog",
    "Piece",
    "PreemptionGuard",
    "ShardConfig",
    "ShardedCheckpointHandler",
    "ShardedRestore",
    "ShardedSave",
    "ShardedState",
    "ShardedTransformation",
    "StepMemory",
    "TrainState",
    "TrainStep",
    "__version__",
    "checksums",
    "clip_by_global_norm",
    "collective_dtypes",
    "compiled_collectives",
    "estimate_memory",
    "from_optax_state",
    "gather",
    "global_norm",
    "init_train_state",
    "layer",
    "layers",
    "lowered_collectives",
    "make_train_step",
    "sharded",
    "state_bytes_per_device",
    "step_memory",
    "summarize",
    "to_optax_state",
]


# Earlier names, kept working with a DeprecationWarning: name -> (its new name, the object).
_DEPRECATED = {
    "Shard": ("zs.Piece", "zeroshard.communication.stage3", "Piece"),
    "Sharded": (
        "tx.optimizer (of a zs.ShardedTransformation)",
        "zeroshard.optimizer.sharded",
        "Sharded",
    ),
    "collectives": (
        "zs.compiled_collectives",
        "zeroshard.measuring.instruments",
        "compiled_collectives",
    ),
}


def __getattr__(name: str):
    """The orbax handler's names (zeroshard.checkpointing.handler), imported on first use;
    the deprecated names (:data:`_DEPRECATED`), with a warning."""
    if name in ("ShardedCheckpointHandler", "ShardedRestore", "ShardedSave"):
        from zeroshard import checkpointing

        return getattr(checkpointing, name)
    if name in _DEPRECATED:
        import importlib
        import warnings

        new, module, attr = _DEPRECATED[name]
        warnings.warn(f"zs.{name} is deprecated: use {new}.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
