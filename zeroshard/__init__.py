"""zeroshard: ZeRO for JAX — optimizer state and master weights sharded over data-parallel devices.

The optimizer: :mod:`~zeroshard.config` (its options), :mod:`~zeroshard.sharded` (the
optax wrapper and its state), :mod:`~zeroshard.update` (the one update flow). The data
flow of one step, module by module: :mod:`~zeroshard.layout` (each leaf's placement and
geometry), :mod:`~zeroshard.placement` (choosing placements from
:mod:`~zeroshard.analysis` of the traced update), :mod:`~zeroshard.arrival` and
:mod:`~zeroshard.departure` (how gradients arrive and weights leave: reduce-scatter,
all-gather, stage-3 pieces), :mod:`~zeroshard.branches` (per-owner work),
:mod:`~zeroshard.stage3` (weights as pieces), :mod:`~zeroshard.step` (the jitted
step). Around the loop: :mod:`~zeroshard.checkpointing` (its manager, metadata record
and integrity checks) with :mod:`~zeroshard.logical`, :mod:`~zeroshard.preemption`,
:mod:`~zeroshard.peers`, :mod:`~zeroshard.memory`.
"""

from importlib import metadata as _metadata

from zeroshard.analysis import NotElementwiseError
from zeroshard.checkpointing import CheckpointCorruptedError, CheckpointManager, checksums
from zeroshard.clipping import ClipByGlobalNormState, clip_by_global_norm, global_norm
from zeroshard.config import ShardConfig
from zeroshard.instruments import (
    Collective,
    collective_dtypes,
    compiled_collectives,
    lowered_collectives,
    state_bytes_per_device,
    summarize,
)
from zeroshard.logical import from_optax_state, to_optax_state
from zeroshard.loss_scale import DynamicLossScale, LossScaleState
from zeroshard.memory import MemoryEstimate, StepMemory, estimate_memory, step_memory
from zeroshard.peers import PeerWatchdog
from zeroshard.preemption import PreemptionGuard
from zeroshard.sharded import ShardedState, ShardedTransformation, sharded
from zeroshard.stage3 import Piece, gather, layer, layers
from zeroshard.step import TrainState, TrainStep, init_train_state, make_train_step

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
    "Shard": ("zs.Piece", "zeroshard.stage3", "Piece"),
    "Sharded": ("tx.optimizer (of a zs.ShardedTransformation)", "zeroshard.sharded", "Sharded"),
    "collectives": ("zs.compiled_collectives", "zeroshard.instruments", "compiled_collectives"),
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
