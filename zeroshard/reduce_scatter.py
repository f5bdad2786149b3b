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

    One ``psum_scatter`` per leaf (see :func:`reduce_scatter_leaves`); the pieces are
    laid end to end into one row per dtype bucket. Padding elements are zero, so they
    stay zero.

    Args:
      grads: this device's local, unreduced gradients (the parameters' tree).
      layout: the parameters' layout.
      axis_name: the mesh axis the batch is split over.
      reduce_dtype: dtype the collective runs in; ``None`` keeps each leaf's dtype.

    Returns:
      One ``(row_size,)`` array per bucket: this device's slice of the mean gradient,
      in ``reduce_dtype`` (or the bucket's dtype).
    """
    pieces = reduce_scatter_leaves(grads, layout, axis_name, reduce_dtype)
    return tuple(jnp.concatenate([pieces[i] for i in b.slots]) for b in layout.buckets)


def reduce_scatter_leaves(
    grads: PyTree, layout: Layout, axis_name: str, reduce_dtype: Any = None
) -> list[jax.Array]:
    """This device's piece of each leaf's mean gradient, one ``psum_scatter`` per leaf.

    A collective per leaf needs no copy of the gradients into a packed buffer, and
    each can start as soon as backward has produced its leaf, overlapping the rest of
    backward. XLA's collective combiners (GPU, TPU) merge small ones again.

    Returns:
      One 1-D piece per leaf, in ``reduce_dtype`` or the gradient's dtype.
    """
    pieces = []
    for leaf, s in zip(layout.treedef.flatten_up_to(grads), layout.slots, strict=True):
        flat = jnp.ravel(leaf).astype(reduce_dtype or leaf.dtype)
        flat = jnp.pad(flat, (0, layout.num_shards * s.piece_size - s.size))
        block = flat.reshape(layout.num_shards, s.piece_size)
        summed = jax.lax.psum_scatter(block, axis_name, scatter_dimension=0, tiled=True)
        pieces.append(summed[0] / layout.num_shards)
    return pieces
