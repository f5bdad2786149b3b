"""State kinds: where one leaf of the inner optimizer's state lives, one class each.

The plan (:mod:`zeroshard.core.placement`) gives every leaf of the inner state a kind,
read from the inner ``init`` traced on each device's view:

- :class:`SlicedState`: per element, shaped like a sliced parameter's pieces (Adam's
  moments);
- :class:`BlockedState`: a blocked parameter's state (:mod:`zeroshard.core.blocks`), kept
  as blocks of rows or columns;
- :class:`OwnedState`: on the device owning its parameter (or each layer on that
  layer's owner), in the storage rows;
- :class:`ReplicatedState`: the same on every device (counts, hyperparameters).

Each is the state leaf's record: its full shape and dtype, its low-bit coding, its
``PartitionSpec`` in the global state, whether it is stored in the owners' rows, and
its bytes per device; the conversions to and from plain optax's form match on the
kind (:mod:`zeroshard.checkpointing.logical`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

from zeroshard.core.lowbit import Codes, LowBit


@dataclasses.dataclass(frozen=True)
class ReplicatedState:
    """The same value on every device.

    Attributes:
      struct: the leaf's full shape (for the full parameters), and its dtype.
      coding: how the state stores it (:class:`zeroshard.core.lowbit.LowBit`: floating
        per-element state of a sliced leaf aligned to the store's blocks), or ``None``
        (as it is).
      stored: whether the value lives in the owners' storage rows, not in the state's
        tree.
    """

    struct: Any = dataclasses.field(default=None, kw_only=True)
    coding: LowBit | None = dataclasses.field(default=None, kw_only=True)
    stored = False

    def encoded(self, x: Any) -> Any:
        """``x`` as the state stores it: coded where the leaf is, else as it is."""
        return self.coding.encode(x) if self.coding else x

    def decoded(self, x: Any) -> Any:
        """The leaf as the inner optimizer reads it, from what the state stores (the
        inverse of :meth:`encoded`)."""
        return self.coding.decode(x) if self.coding else x

    def spec(self, plan: Any, k: int, axis_name: str) -> P | None:
        """``PartitionSpec`` of state leaf ``k`` in the global state (``None``: a leaf
        the tree does not hold)."""
        return P()

    def per_device(self, nbytes: float, num_shards: int) -> float:
        """The bytes one device keeps in the tree of a leaf of ``nbytes`` in the view."""
        return nbytes


@dataclasses.dataclass(frozen=True)
class SlicedState(ReplicatedState):
    """Per element: shaped like sliced parameter ``leaf``'s pieces
    (:attr:`zeroshard.core.layout.Slot.piece_shape`; for a group, its pieces end to end:
    :class:`zeroshard.core.placement.Grouping`)."""

    leaf: int

    def spec(self, plan: Any, k: int, axis_name: str) -> P | None:
        if k in plan.on_state.hidden:
            return None
        spec = plan.layout.slots[self.leaf].spec(axis_name)
        return Codes(spec, spec, self.coding.bits) if self.coding else spec


@dataclasses.dataclass(frozen=True)
class BlockedState(ReplicatedState):
    """A blocked parameter's state kept as blocks along ``axis`` (the axis its update
    computes it along; for one it computes whole, its first that divides by the
    devices). The update traces it whole.

    Attributes:
      axis: the axis it is cut along.
      gathered: whether the update reads it whole (a factor vector broadcast along
        the other axis): gathered before the update, cut after.
    """

    axis: int
    gathered: bool = False

    def spec(self, plan: Any, k: int, axis_name: str) -> P | None:
        ndim = len(self.struct.shape)
        return P(*(axis_name if d == self.axis else None for d in range(ndim)))

    def per_device(self, nbytes: float, num_shards: int) -> float:
        return nbytes / num_shards


@dataclasses.dataclass(frozen=True)
class OwnedState(ReplicatedState):
    """Held where its parameter is owned, in the storage rows.

    Attributes:
      source: the device holding its value as plain optax would (its leaf's owner),
        or ``None`` for one held layer by layer.
      layers_of: for one held layer by layer (its first axis the layers of a
        layer-owned leaf, each on that layer's owner), the leaf, else ``None``.
    """

    source: int | None = None
    layers_of: int | None = None
    stored = True

    def spec(self, plan: Any, k: int, axis_name: str) -> P | None:
        return None

    def per_device(self, nbytes: float, num_shards: int) -> float:
        return 0.0
