"""Canonical: sums in one fixed order, whatever the number of devices.

Floating-point addition is not associative: a sum's bits depend on the order its
terms meet, and in data parallelism that order follows the device count. With
``zs.sharded(..., deterministic=M)`` (``M`` a power of two) every sum of a step runs
in an order fixed by ``M`` alone, so the same global batch gives the same bits on
every device count ``N`` that leaves each device at least two of the ``M``
micro-batches:

- **the gradient** is the sum of ``M`` micro-batch gradients, each of ``B / M``
  examples and computed at that shape, inside a loop, on every ``N``, in one binary
  tree over the micro-batches (:func:`tree_sum`, :func:`in_order`). Device ``d``
  holds micro-batches ``d * M/N`` to ``(d + 1) * M/N - 1``, neighbours. A stage-1
  step sums neighbours first (:data:`LOW`): each device its own micro-batches, then
  one ``all_to_all`` (the bytes of a reduce-scatter) brings each owner every
  device's sum of its piece, added in device order (:func:`summed_rows`). Stages 2
  and 3 reduce every round across the devices, so they sum halves first
  (:data:`HIGH`): round ``j``'s gradients of the devices, then the rounds. Every
  node is summed in float32.
- **every sum over a leaf's elements** in the update (a global norm, LAMB's and
  LARS's trust ratios, Adafactor's RMS, the non-finite verdict) runs over the leaf
  cut into ``M`` canonical chunks of each layer: device ``d``'s piece is ``M / N``
  whole chunks (:class:`zeroshard.core.layout.Slot`'s ``chunks``), each chunk is summed
  in a fixed tree, the chunk sums are gathered and summed in chunk order
  (:func:`leaf_part`, :func:`totals`); a leaf updated whole on its owner is summed
  there, the same way on every ``N``.
- the loss, scalar aux and floating-point model state (BatchNorm statistics) are
  summed over the micro-batches in the gradient's tree; each micro-batch's random
  key is the step's key folded with its index in the global batch.

Elementwise arithmetic (the update itself) gives the same bits on any slice where
the compiler computes each operation the same way in every program (see
:func:`zeroshard.core.sums.evaluate` for the one rewrite that makes a division so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from zeroshard.communication.collectives import (
    all_gathered,
    all_gathered_parts,
    is_identity,
    vary,
)
from zeroshard.core.layout import PyTree, Slot, is_floating
from zeroshard.core.rows import spans
from zeroshard.core.sums import Psum

HIGH, LOW = "high bits first", "low bits first"
"""The two orders of :func:`tree_sum` and :func:`in_order` over ``2**k`` terms: term
``i`` meets term ``i + 2**(k-1)`` first (``HIGH``: the second half added onto the
first, repeatedly), or its neighbour ``i ^ 1`` (``LOW``: neighbours in pairs,
repeatedly). A device's micro-batches are neighbours: the gradients of a stage-1
step are summed ``LOW`` (each device its own first, then the devices' sums in device
order), those of stages 2 and 3, which reduce every round across the devices,
``HIGH``."""


def tree_sum(x: jax.Array, axis: int = 0, order: str = HIGH) -> jax.Array:
    """The sum of ``x`` along ``axis`` in one fixed binary tree (``order``; an odd
    last term carried up). Explicit adds of slices, so the order is the same in
    every program that computes it."""
    x = jnp.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        n, h = x.shape[0], x.shape[0] // 2
        pairs = x[:h] + x[h : 2 * h] if order == HIGH else x[0 : 2 * h : 2] + x[1 : 2 * h : 2]
        x = jnp.concatenate([pairs, x[2 * h :]]) if n % 2 else pairs
    return x[0]


def in_order(
    fn: Callable[[jax.Array], tuple[PyTree, PyTree]], count: int, order: str = HIGH
) -> tuple:
    """``fn(i)`` for ``i`` in ``range(count)`` (a power of two), combined in
    :func:`tree_sum`'s tree over ``i`` (``order``): the first of each pair of outputs
    summed (floating-point leaves; others taken from ``i = 0``), the second
    concatenated along its leading axis in the order of ``i``. The tree's last sum
    joins the even and the odd ``i`` (``HIGH``) or the two halves (``LOW``): one
    ``jax.lax.map`` of two per level, so ``fn`` is traced ``log2(count) + 1`` times,
    not ``count``."""
    if count == 1:
        return fn(jnp.zeros((), jnp.int32))
    half = count // 2
    index = (lambda t, i: 2 * i + t) if order == HIGH else (lambda t, i: t * half + i)
    inner = lambda t: in_order(lambda i: fn(index(t, i)), half, order)
    summed, joined = jax.lax.map(inner, jnp.arange(2))
    add = lambda x: x[0] + x[1] if is_floating(x) else x[0]
    # (2, half * rows) -> in the order of i: the even i's rows and the odd ones'
    # interleaved (HIGH), or the halves one after the other (LOW)
    rows = lambda x: x.reshape(2, half, -1, *x.shape[2:]).swapaxes(0, 1) if order == HIGH else x
    join = lambda x: rows(x).reshape(2 * x.shape[1], *x.shape[2:])
    return jax.tree.map(add, summed), jax.tree.map(join, joined)


def summed_rows(
    blocks: Sequence[jax.Array], axis_name: str, order: str = HIGH, replicas: str | None = None
) -> list[jax.Array]:
    """This device's row of the sum over ``axis_name`` (and the replica axis
    ``replicas``, if any) of each of ``blocks`` (each ``(num_shards, width)``, row
    ``d`` for device ``d``), in float32 and in device order: one ``all_to_all`` of
    them packed (row ``d`` to device ``d``), then each device's rows summed in
    :func:`tree_sum`'s tree (``order``). The batch is split over the replicas major,
    so in its device order they are the high bits: ``HIGH`` sums them first (every
    replica's rows gathered, then summed as one tree), ``LOW`` last (each replica's
    sum, then the replicas' sums): the tree over every device either way."""
    matrix = jnp.concatenate(blocks, 1)
    if not is_identity(matrix, axis_name):
        matrix = jax.lax.all_to_all(matrix, axis_name, 0, 0, tiled=True)
    matrix = matrix.astype(jnp.float32)
    every = lambda x: all_gathered(x, replicas, to="invarying").reshape(-1, *x.shape[1:])
    if replicas is not None and order == HIGH:
        matrix = every(matrix)
    row = tree_sum(matrix, order=order)
    if replicas is not None and order == LOW:
        row = tree_sum(every(row[None]), order=order)
    return [row[a:b] for a, b in spans([x.shape[1] for x in blocks])]


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gathered(
    parts: list[jax.Array], axis_name: str, dtype: Any, replicas: str | None = None
) -> list[jax.Array]:
    """Stage 3's gather of 1-D ``parts`` (one ``(N, w)`` per part, row ``d`` from
    device ``d``) in ``dtype``; its transpose sums the gradients onto each part in
    device order (:func:`summed_rows`, over the replica axis ``replicas`` too), in the
    parts' own dtype (float32 in the step, so no node of the sum is rounded to the
    parameters' dtype). The gathered weights vary over ``replicas``: the same on
    each, but so their gradients reach the transpose unsummed (an invariant input's
    are summed over the axis by jax, in no fixed order)."""
    wholes = all_gathered_parts([p.astype(dtype) for p in parts], axis_name)
    return wholes if replicas is None else [vary(w, replicas) for w in wholes]


def _gathered_forward(parts, axis_name, dtype, replicas):
    return gathered(parts, axis_name, dtype, replicas), [jnp.zeros(0, p.dtype) for p in parts]


def _gathered_backward(axis_name, _, replicas, like, cotangents):
    sums = summed_rows(cotangents, axis_name, HIGH, replicas)
    return ([s.astype(x.dtype) for s, x in zip(sums, like, strict=True)],)


gathered.defvjp(_gathered_forward, _gathered_backward)


Part = tuple[jax.Array, Callable[[jax.Array], jax.Array]]
"""What one device holds of a sum over a leaf: its 1-D float32 partial sums, and how
the ``(num_shards, len)`` matrix of every device's makes the total."""


def leaf_part(x: jax.Array, slot: Slot) -> Part:
    """This device's :data:`Part` of the sum of every element of a leaf, from what it
    holds of it: ``x``, its piece of a sliced leaf (each canonical chunk summed), the
    whole leaf (on its owner, else a stand-in) of a leaf owned whole, or its layers
    of a layer-owned leaf. The total: the chunks in order, then the layers; the
    owner's sum; the layers' sums in layer order."""
    x = x.astype(jnp.float32)
    if not slot.owned:
        local = slot.width // slot.chunk  # chunks per device
        blocks = slot.split.blocks  # (a split leaf's: in order)

        def chunks(every: jax.Array) -> jax.Array:  # (rows: devices, a split leaf's blocks minor)
            per_layer = every.reshape(-1, blocks, slot.layers, local).transpose(2, 1, 0, 3)
            return tree_sum(tree_sum(per_layer.reshape(slot.layers, -1), 1))

        return tree_sum(x.reshape(slot.layers, local, slot.chunk), 2).reshape(-1), chunks
    if not slot.layered:
        return tree_sum(x.reshape(-1))[None], lambda every: every[slot.owner, 0]
    most = max(len(slot.units_of(d)) for d in range(slot.num_shards))
    layers = tree_sum(x.reshape(x.shape[0], -1), 1)
    places = [slot.units_of(d).index(u) for u, d in enumerate(slot.owners)]
    pick = lambda every: tree_sum(every[np.asarray(slot.owners), np.asarray(places)])
    return jnp.pad(layers, (0, most - layers.shape[0])), pick


def unit_part(units: Sequence[jax.Array], owners: Sequence[int]) -> Part:
    """The :data:`Part` of an owned leaf's sum from its units as this device's row
    holds them (valid on each unit's owner): each unit's sum from its owner, the
    units in order."""
    sums = jnp.stack([tree_sum(u.astype(jnp.float32).reshape(-1)) for u in units])
    return sums, lambda every: tree_sum(every[np.asarray(owners), np.arange(len(owners))])


def totals(parts: Sequence[Part], axis_name: str) -> list[jax.Array]:
    """The totals of ``parts`` (see :data:`Part`), the same on every device: every
    device's partial sums in one ``all_gather``, each total combined in its fixed
    order."""
    every = all_gathered(jnp.concatenate([p for p, _ in parts]), axis_name, to="invarying")
    sizes = [p.shape[0] for p, _ in parts]
    return [total(every[:, a:b]) for (a, b), (_, total) in zip(spans(sizes), parts, strict=True)]


def norm_and_finite(squares: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The L2 norm from the leaves' sums of squares (:func:`totals`), summed in leaf
    order, and whether it is finite (a ``nan`` or ``inf`` anywhere makes it so)."""
    squares = tree_sum(jnp.stack(squares))
    return jnp.sqrt(squares), jnp.isfinite(squares)


@dataclasses.dataclass(frozen=True)
class FixedOrder(Psum):
    """Every sum in an order fixed by ``parts`` (``deterministic=parts``): the same
    bits on every device count that leaves each device at least two of the ``parts``
    micro-batches.

    Attributes:
      parts: the micro-batches of the global batch, and the canonical chunks of
        every layer (a power of two).
      slots: the plan's leaves, whose canonical chunks the sums run over (see
        :meth:`over`).
    """

    parts: int
    slots: tuple[Slot, ...] = ()
    any_order = False
    rewrites = True

    @property
    def chunks(self) -> int:
        return self.parts

    def over(self, slots: Sequence[Slot]) -> FixedOrder:
        return dataclasses.replace(self, slots=tuple(slots))

    def check_drop_in(self) -> None:
        raise ValueError(
            f"zs.sharded(..., deterministic={self.parts}) fixes the order of the gradients' "
            "sums, which zeroshard must take: take the gradient in your step with "
            "tx.value_and_grad(loss_fn)(params, batch) instead of jax.grad, or train with "
            "zs.make_train_step (or zs.flax's steps). From jax.grad the gradients arrive "
            "summed already, in an order that depends on the device count."
        )

    def check_devices(self, num_shards: int, axes: str | tuple[str, ...]) -> None:
        if self.parts % num_shards:
            fix = (
                f"pass deterministic={num_shards} or a larger power of two"
                if num_shards & (num_shards - 1) == 0
                else "no power of two is a multiple of it, so use a power-of-two mesh"
            )
            raise ValueError(
                f"deterministic={self.parts} cuts every layer into {self.parts} chunks, a "
                f"whole number of them per device of the state, which is split over the "
                f"{num_shards} devices of {axes!r} (the batch's axes and the mesh's others): "
                f"{fix}."
            )

    def made_whole(self, sums: Any, xs: list, axis: str) -> list:
        """The operands as they are: each partial sum is taken as the leaf's total in
        the fixed order (:meth:`total`)."""
        if sums.whole:
            raise ValueError(
                "zs.sharded(..., deterministic=...): the inner update sums over several "
                "parameters (a global norm, say) including one updated whole on its owner, "
                "whose sum has no fixed order across device counts yet. Clip before the "
                "optimizer that needs whole tensors, or leave deterministic= unset."
            )
        return xs

    def total(self, eqn: Any, sums: Any, xs: list, axis: str) -> list | None:
        """A partial sum made the leaf's total in the fixed order, or an explicit
        ``psum`` of such totals left out (they are totals already)."""
        if sums is None or not (sums.partial is not None or sums.psum):
            return None
        if sums.psum:
            return xs
        part = leaf_part(xs[0], self.slots[sums.partial])
        out = eqn.outvars[0].aval
        return [totals([part], axis)[0].astype(out.dtype).reshape(out.shape)]

    def divided(self, eqn: Any, sums: Any, xs: list, scalars: dict) -> list | None:
        """A division by a scalar made a product with its reciprocal (see
        :func:`scalar_divisor`); a scalar broadcast noted in ``scalars`` (the scalar,
        by the broadcast's variable: a division by it is by the scalar)."""
        if eqn.primitive.name == "broadcast_in_dim" and _rank(eqn.invars[0]) == 0:
            scalars[eqn.outvars[0]] = xs[0]
        divisor = scalar_divisor(eqn, sums, xs, scalars)
        return None if divisor is None else [xs[0] * (1 / divisor).astype(xs[0].dtype)]


def scalar_divisor(eqn: Any, sums: Any, xs: list, scalars: dict) -> Any:
    """The scalar (rank 0) a value is divided by in ``eqn``, if it is such a ``div``.

    XLA compiles ``x / s`` either as a division or as a product with ``1 / s``,
    depending on what the program around it fuses, so the same update can round
    apart in two programs (on one device and on several, say). Written as the
    product, it rounds the same in every program."""
    if eqn.primitive.name != "div" or not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return None  # (an integer division is not a product)
    v = eqn.invars[1]
    if sums is not None and sums.size is not None:
        return xs[1]  # a mean's divisor, made the leaf's size
    if isinstance(v, jex_core.Var) and v in scalars:
        return scalars[v]
    return jnp.asarray(xs[1]) if _rank(v) == 0 else None


def _rank(v: Any) -> int:
    """The rank of a traced variable or literal (a scalar's: 0, even where the
    value is a one-element piece of a parameter, whose rank is its leaf's)."""
    return len(v.aval.shape)
