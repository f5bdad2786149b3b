"""Reduce-scatter: local full gradients -> this device's row of the mean gradient."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.layout import Layout, PyTree


def reduce_scatter_grads(
    grads: PyTree, layout: Layout, axis_name: str, reduce_dtype: Any = None
) -> tuple[jax.Array, ...]:
    """Averages local gradients over ``axis_name``, keeping only this device's row.

    One ``psum_scatter`` per dtype bucket, whatever the number of leaves. Padding
    elements are zero, so they stay zero.

    Args:
      grads: this device's local, unreduced gradients (the parameters' tree).
      layout: the parameters' layout.
      axis_name: the mesh axis the batch is split over.
      reduce_dtype: dtype the collective runs in; ``None`` keeps each bucket's dtype.

    Returns:
      One ``(row_size,)`` array per bucket: this device's slice of the mean gradient,
      in ``reduce_dtype`` (or the bucket's dtype).
    """
    leaves = layout.treedef.flatten_up_to(grads)
    dtypes = [
        jnp.result_type(*(leaves[i] for i in b.slots)) if reduce_dtype is None else reduce_dtype
        for b in layout.buckets
    ]
    rows = []
    for matrix in layout.pack(grads, dtypes):
        summed = jax.lax.psum_scatter(matrix, axis_name, scatter_dimension=0, tiled=True)
        rows.append(summed[0] / layout.num_shards)
    return tuple(rows)


def reduce_scatter_leaves(
    grads: PyTree, layout: Layout, axis_name: str, reduce_dtype: Any = None
) -> list[jax.Array]:
    """Like :func:`reduce_scatter_grads`, but one ``psum_scatter`` per leaf.

    Returns this device's piece of each leaf's mean gradient (1-D, in ``reduce_dtype``
    or the gradient's dtype). With
    a collective per leaf the compiler may free each leaf's full gradient as soon as
    it is scattered, instead of packing the whole bucket first.
    """
    pieces = []
    for leaf, s in zip(layout.treedef.flatten_up_to(grads), layout.slots, strict=True):
        flat = jnp.ravel(leaf).astype(reduce_dtype or leaf.dtype)
        flat = jnp.pad(flat, (0, layout.num_shards * s.piece_size - s.size))
        block = flat.reshape(layout.num_shards, s.piece_size)
        summed = jax.lax.psum_scatter(block, axis_name, scatter_dimension=0, tiled=True)
        pieces.append(summed[0] / layout.num_shards)
    return pieces
