"""zeroshard: ZeRO for JAX — optimizer state and master weights sharded over data-parallel devices.

The data flow of one step, module by module: :mod:`~zeroshard.layout` (partition),
:mod:`~zeroshard.reduce_scatter`, :mod:`~zeroshard.local_update` (the optax wrapper),
:mod:`~zeroshard.all_gather`, :mod:`~zeroshard.train_step`. Around the loop:
:mod:`~zeroshard.checkpoint` (its manager, metadata record and integrity checks),
:mod:`~zeroshard.preemption`, :mod:`~zeroshard.peers`.
"""

from zeroshard.all_gather import all_gather_params
from zeroshard.checkpoint import CheckpointCorruptedError, CheckpointManager, checksums
from zeroshard.clipping import ClipByGlobalNormState, clip_by_global_norm, global_norm
from zeroshard.gather import Shard, gather, layer
from zeroshard.guard import NotElementwiseError
from zeroshard.instruments import (
    Collective,
    collective_dtypes,
    collectives,
    lowered_collectives,
    state_bytes_per_device,
    summarize,
)
from zeroshard.layout import Layout
from zeroshard.local_update import ShardedState, ShardedTransformation, sharded
from zeroshard.logical import from_optax_state, to_optax_state
from zeroshard.loss_scale import DynamicLossScale, LossScaleState
from zeroshard.peers import PeerWatchdog
from zeroshard.planner import MemoryEstimate, estimate_memory
from zeroshard.preemption import PreemptionGuard
from zeroshard.reduce_scatter import reduce_scatter_grads
from zeroshard.train_step import TrainState, TrainStep, init_train_state, make_train_step

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointManager",
    "ClipByGlobalNormState",
    "Collective",
    "DynamicLossScale",
    "Layout",
    "LossScaleState",
    "MemoryEstimate",
    "NotElementwiseError",
    "PeerWatchdog",
    "PreemptionGuard",
    "Shard",
    "ShardedState",
    "ShardedTransformation",
    "TrainState",
    "TrainStep",
    "__version__",
    "all_gather_params",
    "checksums",
    "clip_by_global_norm",
    "collective_dtypes",
    "collectives",
    "estimate_memory",
    "from_optax_state",
    "gather",
    "global_norm",
    "init_train_state",
    "layer",
    "lowered_collectives",
    "make_train_step",
    "reduce_scatter_grads",
    "sharded",
    "state_bytes_per_device",
    "summarize",
    "to_optax_state",
]
