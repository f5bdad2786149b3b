"""All-gather: every device's updated pieces -> the full parameters on every device."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from zeroshard.layout import Layout, PyTree
from zeroshard.reduce_scatter import is_identity


def all_gather_params(
    pieces: Sequence[jax.Array | None],
    layout: Layout,
    axis_name: str,
    pack_bytes: int = 0,
    owned_rows: Sequence[jax.Array | None] = (),
) -> PyTree:
    """Gathers every device's pieces (and owned leaves) into full, replicated parameters.

    In the parameters' (compute) dtypes, with the collectives of
    :func:`zeroshard.reduce_scatter.reduce_scatter_leaves`: one ``all_gather`` per leaf
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
            None if s.owned else p.astype(s.dtype).reshape(s.shape)
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
            row
            if is_identity(row, axis_name)
            else jax.lax.all_gather(row, axis_name, to="invarying")
        )
        for i, s in enumerate(layout.slots):
            if s.owned and s.bucket == b:
                out[i] = layout.owned_leaf(rows, i)
    return out
