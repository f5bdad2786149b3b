"""Config: the options of :func:`zeroshard.sharded`, declared, frozen and validated once.

A :class:`ShardConfig` says how the state is laid out and how a step treats the
gradients: which mesh axis the state is sharded over (and which it is replicated
over), the dtypes of the master weights and of the reduce-scatter, how collectives
are packed, non-finite skipping, loss scaling, stacked layers and forced placements.
The transformation :func:`zeroshard.sharded` returns is built from ``(inner, config)``
and nothing is set on it afterwards.

Example:
    >>> import jax.numpy as jnp
    >>> config = ShardConfig(axis_name="data", master_dtype=jnp.float32, stacked="blocks")
    >>> config.stacked, config.batch_axes
    (('blocks',), ('data',))
    >>> ShardConfig(pack_bytes=-1)
    Traceback (most recent call last):
    ...
    ValueError: pack_bytes must be a non-negative int, got -1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroshard.communication.canonical import FixedOrder
from zeroshard.communication.collectives import axes_of
from zeroshard.communication.quantized import Quantizer, quantizer
from zeroshard.core.layout import Stacked
from zeroshard.core.lowbit import LowBit, lowbit
from zeroshard.core.sums import PSUM, Psum
from zeroshard.optimizer.loss_scale import DynamicLossScale

Placement = Any
"""Forced placements: a tree like the parameters, or a function ``(path, leaf) -> str``,
giving ``"sliced"``, ``"owned"`` or ``None`` (automatic) per leaf."""


def check_stage(stage: int, lowest: int = 1) -> None:
    """Refuses a ZeRO stage other than ``lowest`` (1; 0 for plain data parallelism)
    to 3."""
    if stage not in range(lowest, 4):
        raise ValueError(
            f"stage must be {', '.join(map(str, range(lowest, 3)))} or 3, got {stage!r}."
        )


def kept_apart(stage: int) -> tuple[bool, bool, bool]:
    """What ZeRO ``stage`` (0: plain data parallelism) keeps 1/N per device: the
    optimizer state and master weights (stages 1 to 3), the gradients (2 and 3), the
    weights (3).

    Raises:
      ValueError: for a stage other than 0 to 3.
    """
    check_stage(stage, lowest=0)
    return stage >= 1, stage >= 2, stage >= 3


@dataclasses.dataclass(frozen=True, eq=False)
class ShardConfig:
    """The options of :func:`zeroshard.sharded` (documented there, argument by argument).

    Frozen: a step, a plan or a checkpoint built from a config can rely on it not
    changing. Compared (and hashed) by identity, since ``placement`` and ``stacked``
    may be trees or functions.

    Attributes:
      axis_name: the mesh axis the batch and the state are split over, or a tuple of
        axes (the batch and the state split over all of them, major to minor).
      master_dtype: dtype of the master weights of narrower parameters, or ``None``.
      reduce_dtype: dtype of the gradient reduce-scatter, or ``None`` (the gradients').
      replica_axis: a second data-parallel axis the state is replicated over, or ``None``.
      skip_nonfinite: skip the update everywhere when the mean gradient is not finite.
      pack_bytes: leaves smaller than this share collectives, per dtype.
      loss_scale: dynamic loss scaling, or ``None``.
      stacked: names (a sorted tuple) or a function marking stacked layers, or ``None``.
      placement: forced placements (a tree or a function), or ``None``.
      mesh: the mesh the state lives on when ``init`` and ``update`` run outside
        ``shard_map`` (in the user's own ``jax.jit``), or ``None``: then the mesh set
        with ``jax.set_mesh``, else the mesh of the state's arrays.
      group_alike: update alike sliced leaves as one buffer (see
        :attr:`zeroshard.core.placement.Plan.groups`).
      quantize_grads: ``"int8"``, ``"int4"`` or ``None``: the format the gradients
        are reduced in (:mod:`zeroshard.communication.quantized`).
      quantize_weights: ``"int8"`` or ``None``: the format the new weights are
        gathered in.
      quantize_block: the most elements per quantization block (one float32 scale).
      deterministic: ``None``, or the number of canonical parts (a power of two):
        every sum runs in an order fixed by it, so a step gives the same bits on any
        device count that divides it (:mod:`zeroshard.communication.canonical`).
      state_bits: ``8``, ``4`` or ``None``: the bits the inner optimizer's
        per-element state of matrices is stored in between steps
        (:mod:`zeroshard.core.lowbit`).
      stage: ``1``, ``2`` or ``3``: the ZeRO stage of ``tx.update`` in the user's own
        ``jax.jit`` (:mod:`zeroshard.communication.jit_pieces`).

    Raises:
      TypeError: if an axis name is not a string or ``loss_scale`` is not a
        :class:`zeroshard.DynamicLossScale`.
      ValueError: if ``replica_axis`` equals ``axis_name``, ``pack_bytes`` is negative,
        ``loss_scale`` is given without ``skip_nonfinite`` or with bad constants, a
        quantized format or block is unknown, ``quantize_grads`` comes with a
        ``reduce_dtype``, or ``quantize_weights`` without a ``master_dtype``;
        if ``deterministic`` is not a power of two or comes with quantized
        collectives; if ``stage`` is not 1, 2 or 3.
    """

    axis_name: str | tuple[str, ...] = "data"
    master_dtype: Any = jnp.float32
    reduce_dtype: Any = None
    replica_axis: str | None = None
    skip_nonfinite: bool = True
    pack_bytes: int = 1 << 18
    loss_scale: DynamicLossScale | None = None
    stacked: Stacked = None
    placement: Placement = None
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
    group_alike: bool = True
    quantize_grads: str | None = None
    quantize_weights: str | None = None
    quantize_block: int = 256
    deterministic: int | None = None
    state_bits: int | None = None
    stage: int = 1

    def __post_init__(self) -> None:
        check_stage(self.stage)
        _check_axes(self.axis_name, self.replica_axis)
        lowbit(self.state_bits)  # (checks it)
        _check_quantized(self)
        _check_deterministic(self)
        if not isinstance(self.pack_bytes, int) or self.pack_bytes < 0:
            raise ValueError(f"pack_bytes must be a non-negative int, got {self.pack_bytes!r}.")
        if self.loss_scale is not None:
            _check_loss_scale(self.loss_scale, self.skip_nonfinite)
        if self.mesh is not None:  # (the drop-in spans any mesh: axis_name is checked where
            # the batch is split over it, by the step and the state it builds)
            check_mesh_axes(self.mesh, (), self.replica_axis)
        normal = functools.partial(object.__setattr__, self)  # (frozen: set once, here)
        normal("axis_name", self.axes[0] if len(self.axes) == 1 else self.axes)
        normal("master_dtype", _dtype(self.master_dtype))
        normal("reduce_dtype", _dtype(self.reduce_dtype))
        normal("skip_nonfinite", bool(self.skip_nonfinite))
        normal("group_alike", bool(self.group_alike))
        normal("stacked", _stacked(self.stacked))

    @functools.cached_property
    def sum_order(self) -> Psum:
        """The order of the step's sums (:class:`zeroshard.core.sums.Psum`, or
        :class:`zeroshard.communication.canonical.FixedOrder` with ``deterministic``): chosen here,
        once."""
        return PSUM if self.deterministic is None else FixedOrder(self.deterministic)

    def check_in_jit(self, mesh: Any, pieces: bool, grads: bool = True) -> None:
        """Refuses what stages 2 and 3 in the user's own ``jax.jit`` do not do, on
        ``mesh`` (:mod:`zeroshard.communication.jit_pieces`): the weights' pieces are
        cut over the sharding axes major first (after the replica axis, if any: copied
        over it); and, for an update of ``grads``
        from ``jax.grad``, which reduced them, and the compiler's gathers of weights
        held as ``pieces`` (stage 3), zeroshard can neither fix the sums' order nor
        quantize them (``tx.value_and_grad``'s gradient it reduces itself).

        Raises:
          ValueError: naming the options (or the mesh's axes) and what to do instead.
        """
        first = next((i for i, a in enumerate(mesh.axis_names) if a in self.axes), 0)
        before = [a for a in mesh.axis_names[:first] if a != self.replica_axis]
        if any(mesh.shape[a] > 1 for a in before):  # (the pieces: batch-major)
            raise ValueError(
                f"zs.sharded(..., stage={self.stage}) in your own jax.jit cuts the weights' "
                f"pieces over the sharding axes {self.axes!r} major first, and a mesh of axes "
                f"{dict(mesh.shape)} has others before them (only the replica axis may come "
                "first): put the sharding axes first, or "
                f"train with zs.make_train_step(..., stage={self.stage})."
            )
        if not grads:
            return
        self.sum_order.check_drop_in()  # (deterministic=)
        options = {
            "quantize_grads": self.quantize_grads,
            "quantize_weights": self.quantize_weights if pieces else None,
        }
        given = [f"{k}={v!r}" for k, v in options.items() if v is not None]
        if given:
            raise ValueError(
                f"zs.sharded(..., stage={self.stage}) in your own jax.jit does not support "
                f"{', '.join(given)}: there jax.grad reduces the gradients and (at stage 3) "
                "the compiler gathers the weights, not zeroshard, so neither can travel as "
                "int8 codes (stage 2 quantizes its all-gather of the new weights). Leave it "
                "out, take the gradient with tx.value_and_grad(loss_fn)(params, batch) "
                "instead of jax.grad (zeroshard then reduces it), or train with "
                f"zs.make_train_step(..., stage={self.stage})."
            )

    def at_stage(self, stage: int) -> ShardConfig:
        """This config at ZeRO ``stage`` (itself, where it is its own)."""
        return self if stage == self.stage else dataclasses.replace(self, stage=stage)

    def master_dtype_of(self, dtype: Any) -> np.dtype | None:
        """The dtype of the master weights kept for parameters of ``dtype``, or
        ``None`` where the parameters are precise enough. Gathered as quantized
        codes, the parameters are not the exact weights: every dtype keeps one then."""
        master = self.master_dtype
        if master is None:
            return None
        narrower = jnp.finfo(dtype).bits < jnp.finfo(master).bits
        return master if self.quantize_weights is not None or narrower else None

    @functools.cached_property
    def state_store(self) -> LowBit | None:
        """How coded state leaves are stored (:class:`zeroshard.core.lowbit.LowBit`), or
        ``None``: as the inner optimizer keeps them. Chosen here, once."""
        return lowbit(self.state_bits)

    @property
    def grad_quantizer(self) -> Quantizer | None:
        """How the gradients are quantized on the wire, or ``None`` (exactly)."""
        return quantizer(self.quantize_grads, self.quantize_block)

    @property
    def weight_quantizer(self) -> Quantizer | None:
        """How the new weights are quantized on the wire, or ``None`` (exactly)."""
        return quantizer(self.quantize_weights, self.quantize_block)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the state is split over (``axis_name`` as a tuple)."""
        return axes_of(self.axis_name)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (the replica axis, if any, then the
        sharding axes)."""
        return (*(() if self.replica_axis is None else (self.replica_axis,)), *self.axes)


def _dtype(dtype: Any) -> np.dtype | None:
    return None if dtype is None else jnp.dtype(dtype)


def _stacked(stacked: Stacked) -> Stacked:
    if stacked is None or callable(stacked):
        return stacked
    return tuple(sorted(set((stacked,) if isinstance(stacked, str) else stacked)))


def _check_axes(axis_name: Any, replica_axis: Any) -> None:
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not (isinstance(names, tuple) and names and all(isinstance(a, str) for a in names)):
        raise TypeError(
            f"axis_name must be a mesh axis name (str) or a tuple of them, got {axis_name!r}."
        )
    if not isinstance(replica_axis, str | None):
        raise TypeError(f"replica_axis must be a mesh axis name (str), got {replica_axis!r}.")
    if len(set(names)) < len(names):
        raise ValueError(f"axis_name names an axis twice: {axis_name!r}.")
    if replica_axis in names:
        raise ValueError(
            f"replica_axis must differ from axis_name (both {replica_axis!r}): the state is "
            "sharded over axis_name and replicated over replica_axis."
        )


def _check_quantized(config: ShardConfig) -> None:
    formats = {"quantize_grads": ("int8", "int4"), "quantize_weights": ("int8",)}
    for name, allowed in formats.items():
        value = getattr(config, name)
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {allowed} or None, got {value!r}.")
    block = config.quantize_block
    if not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"quantize_block must be an even int of at least 2, got {block!r}.")
    if config.quantize_grads is not None and config.reduce_dtype is not None:
        raise ValueError(
            "reduce_dtype and quantize_grads both say how the gradients travel: the "
            f"gradients are reduced as {config.quantize_grads} codes, so pass only one."
        )
    if config.quantize_weights is not None and config.master_dtype is None:
        raise ValueError(
            "quantize_weights needs master weights (master_dtype, float32 by default): "
            "the parameters every device holds are the dequantized weights, so the exact "
            "ones are kept in the optimizer state."
        )


def _check_deterministic(config: ShardConfig) -> None:
    parts = config.deterministic
    if parts is None:
        return
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or parts & (parts - 1):
        raise ValueError(
            f"deterministic must be a power of two (the number of micro-batches the global "
            f"batch is cut into, at least the largest device count to run on), got {parts!r}."
        )
    clashes = {  # (what each sums that is not made to run in the fixed order)
        "quantize_grads": (config.quantize_grads, "the reduction of quantized codes"),
        "quantize_weights": (config.quantize_weights, "the reduction of quantized codes"),
    }
    for name, (value, what) in ((k, v) for k, v in clashes.items() if v[0] is not None):
        raise ValueError(
            f"deterministic={parts} does not combine with {name}={value!r}: {what} is not "
            "made to run in the fixed order. Leave it unset to get the same bits on any "
            "device count."
        )


def _check_loss_scale(loss_scale: Any, skip_nonfinite: bool) -> None:
    if not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            f"loss_scale must be a zs.DynamicLossScale, got {type(loss_scale).__name__}."
        )
    if not skip_nonfinite:
        raise ValueError(
            "loss_scale needs skip_nonfinite=True: a scale that is too large overflows the "
            "gradients, and that step must be skipped while the scale halves."
        )
    c = loss_scale
    if not (c.initial > 0 and c.minimum > 0 and c.factor > 1 and c.growth_interval >= 1):
        raise ValueError(
            "DynamicLossScale needs initial > 0, minimum > 0, factor > 1 and "
            f"growth_interval >= 1; got {loss_scale}."
        )


def check_mesh_axes(mesh: Any, axis_name: str | tuple[str, ...], replica_axis: str | None) -> None:
    """Refuses, naming the fix, a mesh that lacks one of the optimizer's axes."""
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    named = [("axis_name", a) for a in axes_of(axis_name)] + [("replica_axis", replica_axis)]
    for name, axis in named:
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(
                f"mesh has no axis {axis!r} (its axes: {tuple(mesh.axis_names)}): the "
                f"optimizer's {name}={axis!r} names no such axis. Pass the mesh the batch is "
                f"split over, or name one of its axes with {name}=."
            )
