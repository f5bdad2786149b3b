"""Arrival: how this device's part of the mean gradient arrives: a source given a codec.

An arrival turns what the backward pass produced into
:data:`zeroshard.communication.codecs.GradParts`, this device's part of the mean
gradient over the sharding axis: a 1-D piece of every sliced leaf and, per bucket, what
it gets of the owned leaves it updates. Its class says where the gradient comes from;
its codec (:mod:`zeroshard.communication.codecs`) how the devices' gradients are summed
on the way (exactly, as quantized codes, or in a fixed order). Each owns its
collectives, their named scopes (:mod:`zeroshard.measuring.scopes`) and their bytes
(``nbytes``). Both are chosen once, where a step or ``tx.update`` is built
(:meth:`zeroshard.core.update.Route.of`):

- :class:`ReduceScatter`: each device's local, unreduced full gradients, inside
  ``shard_map`` (stages 1 and 2, ``tx.update`` in a user's ``shard_map``),
  reduce-scattered by the codec;
- :class:`Pieces`: stage 3 (and stage 2 through a loss that gathers,
  :mod:`zeroshard.training.held`), the gradient of each :class:`zeroshard.Piece` piece,
  summed over the devices by the transpose of its gather (the codec's); the owned
  leaves' pieces go to their owners;
- :class:`MeanPieces`: stages 2 and 3 in the user's ``jax.jit``, the pieces of the mean
  gradient ``jax.grad`` reduced;
- :class:`CutMean`: the mean gradient itself (``tx.update`` in a user's ``jax.jit``,
  where ``jax.grad`` reduced it); each device cuts its part out;
- :class:`PartialSums`: there, its partial sums (weights typed ``reduced`` over the
  batch axes), reduce-scattered.

A new source is one more subclass of :class:`Arrival` defining ``bring`` and
``nbytes`` (and :meth:`Arrival.owned` and :meth:`Arrival.units` if its owned part is
not one row per bucket); a new way of summing, one more codec.
:func:`zeroshard.core.update.updated` takes any of them unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeroshard.communication.codecs import EXACT, Exact, GradParts
from zeroshard.communication.collectives import axes_of, is_identity, vary
from zeroshard.communication.stage3 import full_structs, shard_specs, to_owners
from zeroshard.core.layout import Layout, PyTree
from zeroshard.core.mesh import each_laid_out, keep_axes
from zeroshard.core.placement import Plan
from zeroshard.measuring.scopes import CUT, REDUCE_SCATTER, REPLICA_MEAN, TO_OWNERS, scope
from zeroshard.optimizer.config import ShardConfig


@dataclasses.dataclass(frozen=True)
class Arrival:
    """How gradients arrive: the base of every source (see the module's description).
    Each defines:

    - ``bring(plan, grads)``: this device's part of the mean gradient over the
      sharding axis (:data:`zeroshard.communication.codecs.GradParts`), from ``grads``
      as this source gives them (inside ``shard_map``);
    - ``nbytes(plan)``: bytes per device the arrival's collectives return, summed
      (what :func:`zeroshard.compiled_collectives` reports as ``result_bytes`` in the compiled
      program, where the backend keeps the dtype).

    Attributes:
      config: the sharded optimizer's options (axis, ``reduce_dtype``,
        ``pack_bytes``, replica axis).
      codec: how the devices' gradients are summed
        (:mod:`zeroshard.communication.codecs`).
    """

    config: ShardConfig
    codec: Exact = EXACT

    def nested(self, rest: tuple[str, ...]) -> Arrival:
        """This arrival run manual over the state's other axes ``rest`` too, in a step
        manual over the batch axes (:class:`Nested`): its codec's
        (:meth:`zeroshard.communication.codecs.Exact.nested`)."""
        return dataclasses.replace(self, codec=self.codec.nested(rest))

    def part(self, plan: Plan, grads: PyTree) -> Any:
        """What one micro-batch's ``grads`` add to a 1/N accumulator (stages 2 and 3):
        here, its parts (:meth:`bring`)."""
        return self.bring(plan, grads)

    def parts(self, plan: Plan, summed: Any) -> GradParts:
        """This device's part of the mean gradient from the mean of :meth:`part` over
        the micro-batches: here, that mean."""
        return summed

    def across_replicas(self, parts: GradParts) -> GradParts:
        """``parts`` averaged over the replica axis, if any (once per step, after any
        accumulation), as the codec sums."""
        return self.codec.across_replicas(self.config, parts)

    def part_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """Which of the mesh ``axes`` (the batch's, then any others of the state) the
        parts' blocks are split over as they come (:func:`part_specs`; the codec's)."""
        return self.codec.part_axes(self.config, axes)

    def owned(self, layout: Layout, part: jax.Array, i: int, device: int) -> jax.Array:
        """``device``'s units of owned leaf ``i`` from the owned part of its bucket
        (here: ``device``'s row of the bucket, as :meth:`zeroshard.core.layout.Layout.owned_row`
        packs it)."""
        return layout.owned_local(part, i, device)

    def units(self, layout: Layout, row: jax.Array, slot: Any) -> list[jax.Array]:
        """Each unit of an owned leaf as this device's owned ``row`` holds it, where it
        is the unit's owner."""
        return [row[a:b] for _, a, b in slot.unit_spans()]

    def dtype(self, bucket: Any) -> Any:
        """The dtype a bucket's (or an array's) gradients travel in (the codec's)."""
        return self.codec.dtype(self.config, bucket)

    def norm_and_finite(
        self, plan: Plan, pieces: list[jax.Array | None], rows: tuple[jax.Array | None, ...]
    ) -> tuple[jax.Array, jax.Array]:
        """The global L2 norm of the mean gradient from this device's ``pieces`` and
        owned ``rows``, and whether it is finite
        (:meth:`zeroshard.communication.codecs.Exact.norm_and_finite`)."""
        return self.codec.norm_and_finite(self.config, plan, pieces, rows, self.units)


@dataclasses.dataclass(frozen=True)
class ReduceScatter(Arrival):
    """Local full gradients, reduce-scattered: one collective per leaf of at least
    ``pack_bytes`` (no copy into a packed buffer, and it can start as soon as
    backward has produced the leaf), one per packed group of smaller leaves of one
    dtype, and one per bucket with owned leaves (an ``(N, owned_width)`` matrix whose
    row ``d`` holds the leaves device ``d`` owns), each summed by the codec. Scope
    ``zeroshard/reduce_scatter``."""

    def bring(self, plan: Plan, grads: PyTree) -> GradParts:
        layout, axis = plan.layout, self.config.axis_name
        layout.check_matches(grads, "gradients")
        leaves = layout.treedef.flatten_up_to(grads)
        check_local(leaves, layout, axis)
        with scope(REDUCE_SCATTER):
            # This device's piece of each sliced leaf's mean gradient, and per bucket
            # its row of the mean gradient of the leaves it owns.
            leaves = [x.astype(self.dtype(x)) for x in leaves]
            one = is_identity(leaves, axis)  # one device: its row holds every piece
            # One device: each piece is the whole leaf, raveled (no concatenation).
            pieces = layout.sliced(lambda s, x: s.cut(x, 0) if one else None, leaves)
            for group in () if one else layout.groups(self.config.pack_bytes, plan.leaf_order):
                # (a split leaf's: of the device's block, over the batch axes alone)
                over = layout.slots[group[0]].split.over
                means = self.means([layout.slots[i].moved.blocks(leaves[i]) for i in group], over)
                for i, mean in zip(group, means, strict=True):
                    pieces[i] = mean
            owned = lambda b, bucket: layout.owned_blocks(leaves, b, self.dtype(bucket))
            rows = layout.per_owned_bucket(
                lambda b, bucket: owned(b, bucket)[0] if one else self.means([owned(b, bucket)])[0]
            )
        return pieces, rows

    def means(self, blocks: list[jax.Array], axes: tuple[str, ...] | None = None) -> list:
        """This device's row of the mean over the axis (or ``axes``) of each of
        ``blocks`` (each ``(devices, width)``, row ``d`` for device ``d``): one
        reduce-scatter of them packed, by the codec (its sums, where it gives sums)."""
        return self.codec.rows(self.config, blocks, axes or self.config.axis_name, len(blocks[0]))

    def nbytes(self, plan: Plan) -> int:
        if plan.layout.num_shards == 1:
            return 0
        exact = sum(
            (b.row_size + b.owned_width) * jnp.dtype(self.dtype(b)).itemsize
            for b in plan.layout.buckets
        )
        return self.codec.nbytes(self.config, plan, exact)


@dataclasses.dataclass(frozen=True)
class PartialSums(ReduceScatter):
    """The mean gradient as partial sums over the batch axes ``summed`` (jax's
    ``unreduced`` type: ``jax.grad`` in a user's ``jax.jit`` of weights typed
    ``reduced`` over them, on Explicit axes), reduce-scattered and summed, each copy
    over the state's other axes (a leaf replicated over ``"model"``) counted once."""

    summed: frozenset[str] = frozenset()

    def means(self, blocks: list[jax.Array], axes: tuple[str, ...] | None = None) -> list:
        axes = axes or self.config.axis_name
        partial = math.prod(jax.lax.axis_size(a) for a in axes_of(axes) if a in self.summed)
        return self.codec.rows(self.config, blocks, axes, len(blocks[0]) // partial)

    def across_replicas(self, parts: GradParts) -> GradParts:
        if self.config.replica_axis not in self.summed:
            return parts
        with scope(REPLICA_MEAN):
            return jax.lax.psum(parts, self.config.replica_axis)


@dataclasses.dataclass(frozen=True)
class Pieces(Arrival):
    """Stage 3: the gradient of each :class:`zeroshard.Piece` piece arrives summed over
    the devices (the transpose of its gather, the codec's: scope
    ``zeroshard/reduce_scatter``) and, unless the codec gives sums, is divided by
    their number; the owned leaves' pieces then go to their owners, one
    ``all_to_all`` per bucket with owned leaves (scope ``zeroshard/to_owners``). The
    owned part of a bucket is what every device holds of the units this device owns:
    ``(num_shards, owned_chunk)``.

    Attributes:
      summed_over: ``()``, or the axes the gather's transpose sums the gradients over
        where they are fewer than the state's: the batch axes, in zeroshard's step on
        a mesh with other axes (tensor parallelism's ``"model"``, say), where the
        pieces are cut over those too (:func:`zeroshard.gather`).
    """

    summed_over: tuple[str, ...] = ()

    def nested(self, rest: tuple[str, ...]) -> Arrival:
        batch = tuple(a for a in axes_of(self.config.axis_name) if a not in rest)
        return dataclasses.replace(self, summed_over=batch)

    def bring(self, plan: Plan, grads: PyTree) -> GradParts:
        return self.parts(plan, self.part(plan, grads))

    def part(self, plan: Plan, grads: PyTree) -> list[jax.Array]:
        """This device's 1-D piece of every leaf's mean gradient (its sum, where the
        codec gives sums), from the gradients of the ``Piece`` pieces (what a step
        accumulates over micro-batches)."""
        layout = plan.layout
        layout.check_matches(full_structs(grads), "gradients", full=True)
        grads, summed = layout.treedef.flatten_up_to(grads), self.summed(layout)
        if summed is None:
            return [g.piece.reshape(-1) for g in grads]
        with scope(REDUCE_SCATTER):  # the mean of the pieces the gather's transpose summed
            return [g.piece.reshape(-1) / summed for g in grads]

    def summed(self, layout: Layout) -> int | None:
        """How many devices' gradients each piece's arrives summed over, to divide by
        (``None``: none to divide, where the codec gives sums)."""
        if self.codec.sums:
            return None
        if self.summed_over:
            return math.prod(jax.lax.axis_size(a) for a in self.summed_over)
        return layout.num_shards

    def parts(self, plan: Plan, pieces: list[jax.Array]) -> GradParts:
        """Every leaf's piece -> this device's part: the sliced leaves' pieces, and what
        every device holds of the units it owns."""
        layout = plan.layout
        with scope(TO_OWNERS):
            dtypes = [self.dtype(b) for b in layout.buckets]
            owned = to_owners(pieces, layout, self.config.axis_name, dtypes)
        return layout.sliced(lambda s, p: p, pieces), owned

    def owned(self, layout: Layout, part: jax.Array, i: int, device: int) -> jax.Array:
        return layout.owned_local(part, i, device, pieces=True)

    def units(self, layout: Layout, part: jax.Array, slot: Any) -> list[jax.Array]:
        """Each unit of an owned leaf from every device's pieces of it, as its owner
        receives them."""
        return [slot.unit_geometry().uncut(part[:, a:b]) for _, a, b in slot.unit_spans(True)]

    def dtype(self, bucket: Any) -> Any:
        """Float32 where the codec gives sums: the owned leaves' pieces go to their
        owners as the float32 mean gradient (rounded to the parameters' dtype, Muon's
        bf16 matrices moved apart from plain optax's by more than a bf16 rounding of
        the weights); else the codec's."""
        return jnp.float32 if self.codec.sums else super().dtype(bucket)

    def nbytes(self, plan: Plan) -> int:
        layout = plan.layout
        if layout.num_shards == 1:
            return 0
        return sum(
            layout.num_shards * b.owned_chunk * jnp.dtype(self.dtype(b)).itemsize
            for b in layout.buckets
        )


@dataclasses.dataclass(frozen=True)
class MeanPieces(Pieces):
    """Stages 2 and 3 in the user's ``jax.jit``: each piece's gradient arrives as the
    piece of the mean gradient (``jax.grad`` of the mean loss reduced it), not as the
    sum zeroshard's own gather's transpose gives: nothing to divide."""

    def summed(self, layout: Layout) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class CutMean(Arrival):
    """The mean gradient itself (invariant over the axis: reduced already, as
    ``jax.grad`` in a ``jax.jit`` over a sharded batch reduces it): each device cuts
    its pieces, and its owned row, out of it, with no collective (scope
    ``zeroshard/cut``). It is averaged over every batch axis already, the replica
    axis included."""

    def bring(self, plan: Plan, grads: PyTree) -> GradParts:
        layout = plan.layout
        layout.check_matches(grads, "gradients")
        index = jax.lax.axis_index(self.config.axis_name)
        with scope(CUT):
            leaves = [g.astype(self.dtype(g)) for g in layout.treedef.flatten_up_to(grads)]
            pieces = layout.sliced(lambda s, g: s.own(g, index), leaves)
            rows = layout.per_owned_bucket(
                lambda b, bucket: layout.owned_blocks(leaves, b, self.dtype(bucket))[index]
            )
        return pieces, rows

    def across_replicas(self, parts: GradParts) -> GradParts:
        return parts

    def nbytes(self, plan: Plan) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class Nested:
    """``arrival`` run manual over the state's other axes too (``rest``: mesh axes the
    batch is not split over, e.g. tensor parallelism's ``"model"``), inside a step
    manual over the batch axes only. There each leaf's gradient is whole (the loss's
    own layout over ``rest`` undone) and the same on every device of ``rest``; cast to
    vary over them, its copies summed over every device of the state and divided by
    their count give the mean over the batch axes (the fixed-order sums take one copy
    of each instead). A split leaf's (:class:`zeroshard.core.layout.Split`) stays the
    device's block, reduced over the batch axes alone. At stage 3 the gradients are
    the :class:`zeroshard.Piece` pieces', cut over ``rest`` too and summed over the
    batch axes by their gather's transpose. How each kind runs so is its own
    (:meth:`Arrival.nested`). The parts come back 1/N of every
    leaf, laid out over ``rest`` (:meth:`specs`) for the update, manual over them too.
    It runs inside the loss region, not in the update region: with accumulation at
    stages 2 and 3 each micro-batch's gradient is reduced to its 1/N part as it is
    made (:class:`zeroshard.training.microbatches.Accumulated`), so no whole gradient
    is carried across the micro-batches, and the loss itself runs with ``rest``
    automatic (its own tensor-parallel layout).

    Attributes:
      arrival: how the gradients arrive over every axis of the state.
      rest: the axes of the state the batch is not split over.
    """

    arrival: Arrival
    rest: tuple[str, ...]

    def bring(self, plan: Plan, grads: PyTree) -> GradParts:
        axes, arrival = self.arrival.config.axis_name, self.arrival.nested(self.rest)
        if self.pieces:  # (the pieces' gradients, summed over the batch axes)
            specs = keep_axes(shard_specs(plan.layout, axes), self.rest)
        else:
            specs = plan.layout.leaf_specs()  # (whole, or a split leaf's block)
            grads = each_laid_out(grads, specs)
        run = lambda g: arrival.bring(plan, jax.tree.map(lambda x: vary(x, axes), g))
        nested = jax.shard_map(
            run,
            in_specs=(specs,),
            out_specs=self.specs(plan),
            axis_names=set(self.rest),
            check_vma=plan.layout.num_shards > 1,  # (as the step's: one device, no types)
        )
        return nested(grads)

    @property
    def pieces(self) -> bool:
        """Whether the gradients are stage 3's pieces' (summed by their gather's
        transpose)."""
        return isinstance(self.arrival, Pieces)

    def part(self, plan: Plan, grads: PyTree) -> Any:
        """What one micro-batch adds (see :meth:`Arrival.part`): stage 3's pieces'
        gradients as they come; other gradients brought."""
        return grads if self.pieces else self.bring(plan, grads)

    def parts(self, plan: Plan, summed: Any) -> GradParts:
        """The mean of :meth:`part` over the micro-batches, brought (stage 3)."""
        return self.bring(plan, summed) if self.pieces else summed

    def specs(self, plan: Plan) -> tuple[list, tuple]:
        """``PartitionSpec``s of the parts :meth:`bring` returns: each 1-D, split over
        ``rest``."""
        return part_specs(plan, self.rest)


def part_specs(plan: Plan, axes: tuple[str, ...]) -> tuple[list, tuple]:
    """``PartitionSpec``s of :data:`zeroshard.communication.codecs.GradParts` whose 1-D parts
    are split over ``axes`` (a device's parts one block of each: the form they leave a
    step's loss region in, and enter its update region,
    :func:`zeroshard.core.update.region`)."""
    piece, layout = P(axes), plan.layout
    return [None if s.owned else piece for s in layout.slots], layout.per_owned_bucket(
        lambda b, bucket: piece
    )


def check_local(leaves: list, layout: Layout, axis_name: str) -> None:
    """Refuses gradients typed invariant over ``axis_name`` where types are checked
    (``shard_map``'s default ``check_vma=True``): such a gradient was all-reduced
    already (the gradient of a replicated input is), so reduce-scattering it again
    would make it ``num_shards`` times too large, silently.

    Raises:
      ValueError: naming the first such leaf and the fix (``jax.lax.pcast``).
    """
    if jax.lax.axis_size(axis_name) == 1:
        return
    if axis_name not in jax.typeof(jax.lax.axis_index(axis_name)).manual_axis_type.varying:
        return  # check_vma=False: no types to read
    for g, s in zip(leaves, layout.slots, strict=True):
        if axis_name not in jax.typeof(g).manual_axis_type.varying:
            raise ValueError(
                f"zs.sharded(...).update got a gradient for {s.path} that is the same on "
                f"every device of {axis_name!r} (typed invariant): it was reduced already, "
                "since inside jax.shard_map the gradient of a replicated input is summed over "
                "the devices. Reduce-scattering it again would make it "
                f"{layout.num_shards} times too large. Differentiate with respect to "
                f"jax.lax.pcast(params, {axis_name!r}, to='varying') to get each device's "
                "local gradient; or call tx.update outside shard_map, in a jax.jit, with the "
                "mean gradient."
            )
