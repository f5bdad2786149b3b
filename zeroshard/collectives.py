"""Collectives: the reduce-scatter that opens a step and the all-gather that closes it.

A large leaf has its own collective, with no copy into or out of a packed buffer;
small leaves of one dtype are packed together up to ``pack_bytes`` per collective
(:meth:`zeroshard.layout.Layout.groups`). Owned leaves travel in per-device rows. On
one device (an axis of size 1, with no varying values) every collective is the
identity and is left out (:func:`is_identity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.layout import Layout, PyTree


def is_identity(x: PyTree, axes: str | tuple[str, ...]) -> bool:
    """Whether a collective of ``x`` over ``axes`` is the identity and can be left out:
    the axes hold one device and no leaf of ``x`` is typed as varying over them (in a
    ``shard_map`` with ``check_vma=False``, or on invariant values). Where a leaf is
    varying, only the collective makes it invariant, so it stays."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if any(jax.lax.axis_size(a) != 1 for a in axes):
        return False
    for leaf in jax.tree.leaves(x):
        manual = getattr(jax.typeof(leaf), "manual_axis_type", None)
        if set(getattr(manual, "varying", ())) & set(axes):
            return False
    return True


def reduce_scatter_grads(
    grads: PyTree, layout: Layout, axis_name: str, reduce_dtype: Any = None, pack_bytes: int = 0
) -> tuple[jax.Array, ...]:
    """Averages local gradients over ``axis_name``, keeping only this device's row.

    The collectives are those of :func:`reduce_scatter_leaves`; the pieces are laid
    end to end into one row per dtype bucket. Padding elements are zero, so they stay
    zero.

    Args:
      grads: this device's local, unreduced gradients (the parameters' tree).
      layout: the parameters' layout.
      axis_name: the mesh axis the batch is split over.
      reduce_dtype: dtype the collective runs in; ``None`` keeps each leaf's dtype.
      pack_bytes: leaves smaller than this are packed per dtype, up to this many
        bytes per collective.

    Returns:
      One ``(row_size,)`` array per bucket: this device's slice of the mean gradient,
      in ``reduce_dtype`` (or the bucket's dtype).
    """
    return layout.rows(reduce_scatter_leaves(grads, layout, axis_name, reduce_dtype, pack_bytes))


def reduce_scatter_leaves(
    grads: PyTree, layout: Layout, axis_name: str, reduce_dtype: Any = None, pack_bytes: int = 0
) -> list[jax.Array]:
    """This device's piece of each leaf's mean gradient.

    One ``psum_scatter`` per leaf of ``pack_bytes`` or more: it needs no copy of the
    gradient into a packed buffer, and can start as soon as backward has produced the
    leaf, overlapping the rest of backward. Smaller leaves of one dtype are packed
    together, up to ``pack_bytes`` per ``psum_scatter``, so a model's many biases and
    norms do not pay a collective's fixed cost each (see :meth:`Layout.groups`).

    Returns:
      One 1-D piece per leaf, in ``reduce_dtype`` or the gradient's dtype.
    """
    leaves = layout.treedef.flatten_up_to(grads)
    n = layout.num_shards
    cast = lambda x: x.astype(reduce_dtype or x.dtype)
    if is_identity(leaves, axis_name):  # one device: each piece is the whole leaf
        return [
            None if s.owned else s.cut(cast(x), 0)
            for x, s in zip(leaves, layout.slots, strict=True)
        ]
    pieces: list[jax.Array] = [None] * len(leaves)
    for group in layout.groups(pack_bytes):
        blocks = [layout.slots[i].blocks(cast(leaves[i])) for i in group]
        matrix = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)
        row = jax.lax.psum_scatter(matrix, axis_name, scatter_dimension=0, tiled=True)[0] / n
        for i, start, stop in layout.columns(group):
            pieces[i] = row[start:stop]
    return pieces


def reduce_scatter_owned(
    grads: PyTree, layout: Layout, axis_name: str, reduce_dtype: Any = None
) -> tuple[jax.Array | None, ...]:
    """This device's row of the mean gradient of the leaves it owns, per bucket.

    One ``psum_scatter`` per bucket with owned leaves, of an ``(N, owned_width)``
    matrix whose row ``d`` holds the leaves (and layers) device ``d`` owns: the same
    bytes as slicing them, plus the padding of the most loaded device.

    Returns:
      Per bucket, an ``(owned_width,)`` row (``None`` where the bucket owns nothing).
    """
    leaves = layout.treedef.flatten_up_to(grads)
    n = layout.num_shards
    if is_identity(leaves, axis_name):  # one device: its row holds every owned leaf
        return tuple(
            layout.owned_blocks(leaves, b, reduce_dtype or bucket.dtype)[0]
            if bucket.owned_width
            else None
            for b, bucket in enumerate(layout.buckets)
        )
    return tuple(
        jax.lax.psum_scatter(
            layout.owned_blocks(leaves, b, reduce_dtype or bucket.dtype), axis_name, tiled=True
        )[0]
        / n
        if bucket.owned_width
        else None
        for b, bucket in enumerate(layout.buckets)
    )


def all_gather_params(
    pieces: Sequence[jax.Array | None],
    layout: Layout,
    axis_name: str,
    pack_bytes: int = 0,
    owned_rows: Sequence[jax.Array | None] = (),
) -> PyTree:
    """Gathers every device's pieces (and owned leaves) into full, replicated parameters.

    In the parameters' (compute) dtypes, with the collectives of
    :func:`reduce_scatter_leaves`: one ``all_gather`` per leaf
    of ``pack_bytes`` or more, whose result is the leaf itself (a reshape, plus a
    slice where the leaf was padded, and a transpose for stacked layers), and one per
    packed group of smaller leaves.

    Args:
      pieces: this device's 1-D piece of each sliced leaf (any dtype; cast to the
        leaf's); ``None`` for owned leaves.
      layout: the parameters' layout.
      axis_name: the mesh axis the pieces are spread over.
      pack_bytes: leaves smaller than this are packed per dtype, up to this many
        bytes per collective.
      owned_rows: per bucket, this device's row of the leaves it owns (``None``
        where the bucket owns nothing): one ``all_gather`` per bucket, each owned
        leaf taken from its owner's row.

    Returns:
      The full parameter tree, invariant over ``axis_name`` (usable with ``P()``).
    """
    leaves: list[jax.Array] = [None] * len(layout.slots)
    groups = layout.groups(pack_bytes)
    if is_identity([p for p in pieces if p is not None], axis_name):  # one device
        leaves = [
            None if s.owned else s.uncut(p.astype(s.dtype))
            for p, s in zip(pieces, layout.slots, strict=True)
        ]
        groups = ()
    for group in groups:
        own = [pieces[i].astype(layout.slots[i].dtype) for i in group]
        row = own[0] if len(own) == 1 else jnp.concatenate(own)
        full = jax.lax.all_gather(row, axis_name, tiled=False, to="invarying")  # (N, row)
        for i, start, stop in layout.columns(group):
            leaves[i] = layout.slots[i].uncut(full[:, start:stop])
    for i, leaf in all_gather_owned(owned_rows, layout, axis_name).items():
        leaves[i] = leaf
    return layout.treedef.unflatten(leaves)


def all_gather_owned(
    owned_rows: Sequence[jax.Array | None], layout: Layout, axis_name: str
) -> dict[int, jax.Array]:
    """The owned leaves, full and replicated, from every device's owned rows (one
    ``all_gather`` per bucket, in the bucket's dtype)."""
    out = {}
    for b, row in enumerate(owned_rows):
        if row is None:
            continue
        row = row.astype(layout.buckets[b].dtype)
        rows = (
            row[None]
            if is_identity(row, axis_name)
            else jax.lax.all_gather(row, axis_name, to="invarying")
        )
        for i, s in enumerate(layout.slots):
            if s.owned and s.bucket == b:
                out[i] = layout.owned_full(rows, i)
    return out
