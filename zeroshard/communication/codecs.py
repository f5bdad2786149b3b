"""Codecs: how the devices' gradients are summed, one class per policy.

An arrival (:mod:`zeroshard.communication.arrival`) says where this device's part of
the mean gradient comes from (local gradients, partial sums, stage 3's pieces, the
mean itself); its codec says how the devices' gradients are summed on the way, chosen
once with it (:meth:`zeroshard.core.update.Route.of`), from the options:

- :class:`Exact`: in the compiler's order (``psum_scatter``, ``pmean`` over the
  replica axis); the default;
- :class:`Quantized`: as blockwise integer codes (``quantize_grads``;
  :mod:`zeroshard.communication.quantized`), averaged over the replica axis in two
  levels;
- :class:`Canonical`: in one fixed order (``deterministic=``;
  :mod:`zeroshard.communication.canonical`), the same bits on any device count,
  returned as sums (the step divides the rounds' sum by the micro-batch count).

At stage 3 the sum runs in the transpose of each layer's gather, so a codec gives the
step its gather too (:meth:`Exact.gather`). Its methods take the sharded optimizer's
options (``config``: its axis, replica axis, ``reduce_dtype``, quantizers), which
hold what a codec sums over and with.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from zeroshard.communication import canonical, quantized
from zeroshard.communication.collectives import axes_of, is_identity, summed_parts
from zeroshard.communication.stage3 import exact_gather
from zeroshard.core.placement import Plan
from zeroshard.measuring.scopes import REPLICA_MEAN, scope
from zeroshard.optimizer.config import ShardConfig

GradParts = tuple[list[jax.Array | None], tuple[jax.Array | None, ...]]
"""This device's part of the mean gradient: a 1-D piece per sliced leaf (``None`` for
owned leaves), and per bucket its part of the owned leaves (``None`` if it has none)."""


@dataclasses.dataclass(frozen=True)
class Exact:
    """Sums in the compiler's order: the base of every codec.

    Attributes:
      sums: whether what arrives are sums, which the step divides (else means).
    """

    sums: ClassVar[bool] = False

    def rows(self, config: ShardConfig, blocks: list, axes: Any, over: int) -> list:
        """This device's row of the sum over ``axes`` of each of ``blocks`` (each
        ``(devices, width)``, row ``d`` for device ``d``), divided by ``over``: one
        reduce-scatter of them packed."""
        return summed_parts(blocks, axes, over=over)

    def across_replicas(self, config: ShardConfig, parts: GradParts) -> GradParts:
        """``parts`` averaged over the replica axis, if any (once per step, after any
        accumulation)."""
        if config.replica_axis is None:
            return parts
        with scope(REPLICA_MEAN):
            return jax.lax.pmean(parts, config.replica_axis)

    def part_axes(self, config: ShardConfig, axes: tuple[str, ...]) -> tuple[str, ...]:
        """Which of the mesh ``axes`` the parts' blocks are split over as they come:
        all of them, each replica with its own copy until :meth:`across_replicas`."""
        return axes

    def dtype(self, config: ShardConfig, bucket: Any) -> Any:
        """The dtype a bucket's (or an array's) gradients travel in."""
        return config.reduce_dtype or bucket.dtype

    def nbytes(self, config: ShardConfig, plan: Plan, exact: int) -> int:
        """Bytes per device of a reduce-scatter whose exact sums return ``exact``."""
        return exact

    def nested(self, rest: tuple[str, ...]) -> Exact:
        """This codec where the gradients are copies over the state's other axes
        ``rest`` (:class:`zeroshard.communication.arrival.Nested`): itself, where
        summing every copy and dividing by every device gives the mean."""
        return self

    def gather(self, config: ShardConfig) -> Callable[..., list]:
        """Stage 3's gather of a dtype's pieces, ``gather(pieces, axis_name, dtype)``,
        whose transpose sums the gradients by this codec (the weights' codes where
        ``quantize_weights`` says)."""
        if config.weight_quantizer is None:
            return exact_gather
        return functools.partial(quantized.quantized_gather, config.weight_quantizer, None)

    def norm_and_finite(
        self, config: ShardConfig, plan: Plan, pieces: list, rows: tuple, units_of: Callable
    ) -> tuple[jax.Array, jax.Array]:
        """The global L2 norm of the mean gradient from this device's part (its
        ``pieces`` of the sliced leaves, by leaf, grouped as
        :attr:`zeroshard.core.placement.Plan.on_view` holds them, and its owned
        ``rows``), and whether it is finite: one scalar all-reduce, so every device
        takes the same decision. A ``nan`` or ``inf`` anywhere makes the summed squares
        non-finite, so they carry the verdict with no reduction of their own (as does
        a norm past float32's range, about 1.8e19, where every update would overflow
        anyway). Each leaf's squares are summed alone, then the leaves' sums in leaf
        order (the same bits with groups as without: :func:`in_order`).
        ``units_of(layout, row, slot)`` gives an owned leaf's units from its bucket's
        row, where a codec needs them."""
        axis, square = config.axis_name, lambda x: jnp.sum(jnp.square(x.astype(jnp.float32)))
        sums = [*plan.on_view.each(square, pieces), *(square(r) for r in rows if r is not None)]
        squares = in_order([x for x in sums if x is not None])
        if not is_identity(squares, axis):
            squares = jax.lax.psum(squares, axis)
        return jnp.sqrt(squares), jnp.isfinite(squares)


def in_order(sums: list[jax.Array]) -> jax.Array:
    """The sum of ``sums`` (each a scalar, or a vector of one element: a grouped leaf's,
    :meth:`zeroshard.core.placement.Grouping.each`), added one by one in their order,
    as a scalar. Each is added in the shape it comes in, the running sum reshaped
    where that changes: converted to one shape first, each a reshape, XLA's reshape
    mover moved one of them down the chain per round of its simplification passes,
    which then ran to their limit of 25 rounds over the whole step (at 512 leaves on
    jax 0.12.1 XLA's passes over a stage-3 step took 10.9 s, not 4.9). The same bits
    as a sum from zero: no sum of squares is ``-0.0``."""
    total = sums[0] if sums else jnp.float32(0)
    for x in sums[1:]:
        total = (total if total.shape == x.shape else total.reshape(x.shape)) + x
    return total.reshape(())


EXACT = Exact()
"""The default codec."""


@dataclasses.dataclass(frozen=True)
class Quantized(Exact):
    """Sums of blockwise int8 or int4 codes (``config.grad_quantizer``): one
    ``all_to_all`` of codes and one of scales per reduce-scatter of :class:`Exact`,
    decoded and summed in float32 (:func:`zeroshard.communication.quantized.reduce_scatter`;
    at stage 3, in the gather's transpose), averaged over the replica axis in two
    levels (:func:`zeroshard.communication.quantized.all_reduce`)."""

    def rows(self, config: ShardConfig, blocks: list, axes: Any, over: int) -> list:
        return [x / over for x in quantized.reduce_scatter(config.grad_quantizer, blocks, axes)]

    def across_replicas(self, config: ShardConfig, parts: GradParts) -> GradParts:
        if config.replica_axis is None:
            return parts
        arrays, tree = jax.tree.flatten(parts)
        with scope(REPLICA_MEAN):
            means = quantized.all_reduce(config.grad_quantizer, arrays, config.replica_axis)
        means = [m.astype(x.dtype) for m, x in zip(means, arrays, strict=True)]
        return jax.tree.unflatten(tree, means)

    def nbytes(self, config: ShardConfig, plan: Plan, exact: int) -> int:
        widths = plan.layout.collective_widths(config.pack_bytes, plan.leaf_order)
        return sum(n * config.grad_quantizer.nbytes(w) for n, w in widths)

    def gather(self, config: ShardConfig) -> Callable[..., list]:
        weights, grads = config.weight_quantizer, config.grad_quantizer
        return functools.partial(quantized.quantized_gather, weights, grads)


@dataclasses.dataclass(frozen=True)
class Canonical(Exact):
    """Sums in device order, the same bits on any device count (``deterministic=``):
    one ``all_to_all`` per reduce-scatter of :class:`Exact` (the same bytes on the
    wire), each device's rows summed in float32 in a fixed tree
    (:func:`zeroshard.communication.canonical.summed_rows`), over the replica axis too
    (so they come summed over every replica), and returned as sums; the gradient norm
    from the leaves' canonical totals.

    Attributes:
      order: the tree's (:data:`zeroshard.communication.canonical.LOW` for a stage-1
        step, whose devices bring the sums of their own micro-batches).
      copies: ``()``, or the state's axes over which the gradients are copies (the
        mesh's other axes, in a step nested over them): each device sums the rows of
        its own index there, one copy of each batch device's, so the sum is the
        fixed-order one over the batch axes alone.
    """

    sums: ClassVar[bool] = True
    order: str = canonical.HIGH
    copies: tuple[str, ...] = ()

    def rows(self, config: ShardConfig, blocks: list, axes: Any, over: int) -> list:
        axes = axes_of(axes)
        if self.copies and set(self.copies) <= set(axes):  # (rows of devices, copies minor)
            index, n = jax.lax.axis_index(self.copies), jax.lax.axis_size(self.copies)
            blocks = [jnp.take(b.reshape(-1, n, b.shape[-1]), index, axis=1) for b in blocks]
            axes = tuple(a for a in axes if a not in self.copies)
        return canonical.summed_rows(blocks, axes, self.order, config.replica_axis)

    def across_replicas(self, config: ShardConfig, parts: GradParts) -> GradParts:
        return parts

    def part_axes(self, config: ShardConfig, axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for a in axes if a != config.replica_axis)

    def dtype(self, config: ShardConfig, bucket: Any) -> Any:
        """Float32 for a stage-1 step (``LOW``): what travels are the devices' sums of
        their rounds, which rounded to the parameters' dtype would round apart on
        another device count; else :meth:`Exact.dtype`."""
        return jnp.float32 if self.order == canonical.LOW else super().dtype(config, bucket)

    def nbytes(self, config: ShardConfig, plan: Plan, exact: int) -> int:
        return plan.layout.num_shards * exact

    def nested(self, rest: tuple[str, ...]) -> Canonical:
        return dataclasses.replace(self, copies=rest)

    def gather(self, config: ShardConfig) -> Callable[..., list]:
        return functools.partial(canonical.gathered, replicas=config.replica_axis)

    def norm_and_finite(
        self, config: ShardConfig, plan: Plan, pieces: list, rows: tuple, units_of: Callable
    ) -> tuple[jax.Array, jax.Array]:
        layout, parts, pieces = plan.layout, [], plan.on_view.ungrouped(pieces)
        square = lambda x: jnp.square(x.astype(jnp.float32))
        for i, s in enumerate(layout.slots):
            if not s.owned:
                parts.append(canonical.leaf_part(square(pieces[i]), s))
                continue
            units = units_of(layout, rows[s.bucket], s)
            parts.append(canonical.unit_part([square(u) for u in units], s.owners))
        return canonical.norm_and_finite(canonical.totals(parts, config.axis_name))
