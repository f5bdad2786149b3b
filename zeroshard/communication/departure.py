"""Departure: how the new weights leave the update, and how the weights are held.

A departure knows the form the parameters are held in between steps, so it reads the
current weights in that form (this device's pieces of the sliced leaves, the owned
leaves' weights for their owners) and sends the new ones back in it. Each kind owns
its collectives, their named scopes (:mod:`zeroshard.measuring.scopes`) and their bytes
(``nbytes``). It is chosen once, where a step or ``tx.update`` is built:

- :class:`AllGather`: parameters whole and replicated (stages 1 and 2, ``tx.update``):
  the new pieces and owned rows are all-gathered (16-bit floats as their bits);
- :class:`ToPieces`: stage 3, parameters as :class:`zeroshard.Piece` pieces: the
  sliced leaves' new pieces stay where they are; the owners' new units of owned
  leaves go back to every device's pieces (one ``all_to_all`` per bucket).

- :class:`QuantizedAllGather`: the all-gather of :class:`AllGather` as blockwise
  int8 codes (``quantize_weights``; stage 3 quantizes in its gathers instead).

:func:`departure_of` chooses one. A new kind is one more subclass of :class:`Departure`;
:func:`zeroshard.core.update.updated` takes any of them unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.communication import quantized
from zeroshard.communication.collectives import all_gathered_parts, from_bits, is_identity, to_bits
from zeroshard.communication.stage3 import (
    exchange,
    piece_blocks,
    piece_from_owners,
    shard_specs,
    to_owners,
    to_shards,
)
from zeroshard.core.branches import owned_wholes
from zeroshard.core.layout import Layout, PyTree
from zeroshard.core.placement import Grouping, Plan
from zeroshard.measuring.scopes import ALL_GATHER, FROM_OWNERS, TO_OWNERS, UPDATE, scope
from zeroshard.optimizer.config import ShardConfig


@dataclasses.dataclass(frozen=True)
class Departure:
    """How weights are held and leave: the base of every kind (see the module's
    description). Each kind defines:

    - ``own_pieces(plan, params)``: this device's 1-D piece of every sliced leaf of
      ``params``; ``None`` for owned leaves;
    - ``owned_weights(plan, params)``: the current weights of the owned leaves, as
      ``local`` reads them;
    - ``local(plan, branch, weights, device)``: per leaf, what ``device`` (on
      ``branch``) holds of the owned leaves it updates, from ``owned_weights``
      (``None`` where it holds nothing, or where the update reads no weights);
    - ``row(layout, new, device, bucket, dtype)``: ``device``'s new owned leaves of
      ``bucket`` (``new[i]``: its units of leaf ``i``) packed for ``send``;
    - ``send(plan, new, rows, params)``: the new parameters, laid out as ``params``,
      from this device's new pieces of the sliced leaves (grouped, as
      :attr:`zeroshard.core.placement.Plan.on_view` holds them) and its ``row`` per bucket;
    - ``nbytes(plan)``: bytes per device the departure's collectives return, summed
      (as :func:`zeroshard.compiled_collectives` reports ``result_bytes``), over more than one
      device.

    - ``param_specs(layout, axis_name)``: the ``PartitionSpec`` of every parameter
      as the weights are held between steps.

    Attributes:
      config: the sharded optimizer's options (axis, ``pack_bytes``).
      pieces: whether the weights are held as stage 3's pieces between steps (else
        whole: a split leaf's block).
    """

    config: ShardConfig
    pieces = False


@dataclasses.dataclass(frozen=True)
class AllGather(Departure):
    """Whole, replicated parameters: one ``all_gather`` per leaf of at least
    ``pack_bytes`` (its result is the leaf itself: a reshape, plus a slice where the
    leaf was padded), one per packed group of smaller leaves, and one per bucket with
    owned leaves (each owned leaf taken from its owner's row), in the parameters'
    dtypes. Scope ``zeroshard/all_gather``."""

    def param_specs(self, layout: Layout, axis_name: str) -> PyTree:
        return layout.leaf_specs()

    def own_pieces(self, plan: Plan, params: PyTree) -> list[jax.Array | None]:
        return plan.layout.pieces(params, jax.lax.axis_index(self.config.axis_name))

    def owned_weights(self, plan: Plan, params: PyTree) -> list[jax.Array | None]:
        with scope(UPDATE):
            return owned_wholes(plan, params)

    def local(self, plan: Plan, branch: int, weights: Any, device: int) -> list:
        return plan.local_wholes(branch, weights, self.config.axis_name)

    def row(self, layout: Layout, new: list, device: int, bucket: int, dtype: Any) -> jax.Array:
        return layout.owned_row(new, device, bucket, dtype)

    def send(self, plan: Plan, new: list, rows: tuple, params: PyTree) -> PyTree:
        with scope(ALL_GATHER):
            return self.gather(plan.layout, new, rows, plan.leaf_order, plan.on_view)

    def gather(
        self,
        layout: Layout,
        pieces: Sequence[jax.Array | None],
        rows: Sequence[jax.Array | None],
        order: Sequence[int] | None = None,
        grouping: Grouping | None = None,
    ) -> PyTree:
        """The full parameter tree, invariant over the axis (usable with ``P()``), from
        this device's 1-D piece of each sliced leaf (any dtype; cast to the leaf's;
        held as ``grouping`` holds them, if given: each run of a group's leaves in a
        packed collective goes in as one slice of its buffer) and its row of owned
        leaves per bucket (``None`` where it owns nothing); small leaves packed in
        ``order`` (see :meth:`zeroshard.core.layout.Layout.groups`)."""
        # One device: each leaf is its piece, reshaped (no concatenation).
        one = is_identity([p for p in pieces if p is not None], self.config.axis_name)
        grouping = grouping or Grouping(layout.treedef, (), False)
        pieces = grouping.ungrouped(pieces) if one else pieces
        leaves = layout.sliced(lambda s, p: s.uncut(p.astype(s.dtype)) if one else None, pieces)
        for group in () if one else layout.groups(self.config.pack_bytes, order):
            runs = grouping.runs(pieces, group)
            parts = [x.astype(layout.slots[run[0]].dtype) for run, x in runs]
            # (a split leaf's: the device's block, from the pieces over the batch axes)
            fulls = self.everyone(parts, layout.slots[group[0]].split.over)
            for (run, _), full in zip(runs, fulls, strict=True):
                width = full.shape[1] // len(run)
                for k, i in enumerate(run):
                    part = full if len(run) == 1 else full[:, k * width : (k + 1) * width]
                    leaves[i] = layout.slots[i].moved.uncut(part)
        fulls = layout.per_owned_bucket(lambda b, x: self.everyone([rows[b].astype(x.dtype)])[0])
        for i in (i for i, s in enumerate(layout.slots) if s.owned):
            leaves[i] = layout.owned_full(fulls[layout.slots[i].bucket], i)
        return layout.treedef.unflatten(leaves)

    def everyone(self, parts: list[jax.Array], axes: tuple[str, ...] | None = None) -> list:
        """Every device's ``parts`` (1-D, one dtype), invariant over the axis (or
        ``axes``): one ``(devices, width)`` per part, row ``d`` from device ``d``; one
        all-gather of them packed."""
        dtype = parts[0].dtype
        bits = [to_bits(p) for p in parts]
        every = all_gathered_parts(bits, axes or self.config.axis_name, to="invarying")
        return [from_bits(x, dtype) for x in every]

    def nbytes(self, plan: Plan) -> int:
        layout, n = plan.layout, plan.layout.num_shards
        owned = sum(n * b.owned_width * b.dtype.itemsize for b in layout.buckets)
        # (a split leaf's pieces are gathered over the batch axes alone)
        sliced = layout.sliced(lambda s: s.moved.num_shards * s.piece_size * s.dtype.itemsize)
        return owned + sum(x for x in sliced if x is not None)


@dataclasses.dataclass(frozen=True)
class QuantizedAllGather(AllGather):
    """Whole, replicated parameters gathered as blockwise int8 codes
    (:func:`zeroshard.communication.quantized.all_gather`: one all-gather of codes and one of scales
    per collective of :class:`AllGather`). Every device, the owner included, holds the
    decoded weights; the exact ones stay in the optimizer state's master weights,
    which every bucket keeps. Scope ``zeroshard/all_gather``."""

    def send(self, plan: Plan, new: list, rows: tuple, params: PyTree) -> PyTree:
        with scope(ALL_GATHER):  # (each leaf its own part: blocks never span two leaves)
            return self.gather(plan.layout, plan.on_view.ungrouped(new), rows, plan.leaf_order)

    def everyone(self, parts: list[jax.Array], axes: tuple[str, ...] | None = None) -> list:
        axis, dtype = axes or self.config.axis_name, parts[0].dtype
        if is_identity(parts, axis):  # nothing is sent
            return [p[None] for p in parts]
        return quantized.all_gather(
            self.config.weight_quantizer, parts, axis, dtype, to="invarying"
        )

    def nbytes(self, plan: Plan) -> int:
        layout = plan.layout
        widths = layout.collective_widths(self.config.pack_bytes, plan.leaf_order)
        return sum(n * self.config.weight_quantizer.nbytes(w) for n, w in widths)


@dataclasses.dataclass(frozen=True)
class ToPieces(Departure):
    """Stage-3 parameters, :class:`zeroshard.Piece` pieces: the owned leaves' weights
    go to their owners first where the update reads them and no master holds them
    (scope ``zeroshard/to_owners``), and the owners' new units go back to every
    device's pieces (scope ``zeroshard/from_owners``), one ``all_to_all`` per bucket
    each way."""

    pieces = True

    def param_specs(self, layout: Layout, axis_name: str) -> PyTree:
        return shard_specs(layout, axis_name)

    def own_pieces(self, plan: Plan, params: PyTree) -> list[jax.Array | None]:
        layout = plan.layout
        return layout.sliced(lambda s, x: x.piece.reshape(-1), layout.treedef.flatten_up_to(params))

    def owned_weights(self, plan: Plan, params: PyTree) -> tuple[jax.Array | None, ...]:
        """Per bucket what each device holds of this device's units (``(num_shards,
        owned_chunk)``), where the bucket keeps no master and the update reads them
        (Muon without weight decay does not); else ``None``."""
        layout, axis = plan.layout, self.config.axis_name
        with scope(TO_OWNERS):
            pieces = [x.piece.reshape(-1) for x in layout.treedef.flatten_up_to(params)]
            read = self.read_buckets(plan)
            dtypes = [d if b in read else None for b, d in enumerate(plan.inner_dtypes)]
            return to_owners(pieces, layout, axis, dtypes)

    def local(self, plan: Plan, branch: int, weights: Any, device: int) -> list:
        def units(i, s, _):
            read = weights[s.bucket] is not None and not unread(plan, i)
            return plan.layout.owned_local(weights[s.bucket], i, device, True) if read else None

        return plan.in_branch(branch, units)

    def row(self, layout: Layout, new: list, device: int, bucket: int, dtype: Any) -> jax.Array:
        return piece_blocks(layout, new, device, bucket, dtype)

    def send(self, plan: Plan, new: list, rows: tuple, params: PyTree) -> PyTree:
        layout = plan.layout
        leaves = layout.treedef.flatten_up_to(params)
        with scope(FROM_OWNERS):
            back = exchange(rows, self.config.axis_name)  # the owners' units -> pieces
            new = plan.on_view.ungrouped(new)
            for i in (i for i, s in enumerate(layout.slots) if s.owned):
                new[i] = _new_piece(plan, i, back, leaves[i])
            return to_shards(layout, new)

    def read_buckets(self, plan: Plan) -> set[int]:
        """The buckets with owned leaves whose update reads weights no master holds."""
        return {
            s.bucket
            for i, s in enumerate(plan.layout.slots)
            if s.owned and plan.master_dtypes[s.bucket] is None and not unread(plan, i)
        }

    def nbytes(self, plan: Plan) -> int:
        layout, n = plan.layout, plan.layout.num_shards
        width = lambda b: (
            n * layout.buckets[b].owned_chunk * jnp.dtype(plan.inner_dtypes[b]).itemsize
        )
        back = sum(width(b) for b in range(len(layout.buckets)))  # owned_chunk 0: no owned
        return back + sum(width(b) for b in self.read_buckets(plan))


def unread(plan: Plan, i: int) -> bool:
    """Whether owned leaf ``i``'s stage-3 weights stay with their pieces: no master holds
    them and the update does not read them, so its owners get zeros for them, and
    what they send back is the update (zeros plus the update), which each device adds
    to its piece: the same sum as the owner's would be."""
    return plan.master_dtypes[plan.layout.slots[i].bucket] is None and i not in plan.analysis.reads


def _new_piece(plan: Plan, i: int, back: tuple, old: Any) -> jax.Array:
    """This device's new stage-3 piece of owned leaf ``i`` from what its owners sent
    (``back``: per bucket, ``(num_shards, owned_chunk)``, row ``d`` from device ``d``)."""
    received = piece_from_owners(plan.layout, back[plan.layout.slots[i].bucket], i)
    return old.piece.reshape(-1) + received.astype(old.dtype) if unread(plan, i) else received


def departure_of(config: ShardConfig, pieces: bool) -> Departure:
    """How the new weights leave, chosen here for every entry point: as stage 3's
    ``pieces``, else all-gathered (as int8 codes where ``config`` quantizes them)."""
    if pieces:
        return ToPieces(config)
    return (QuantizedAllGather if config.weight_quantizer else AllGather)(config)
