"""All-gather: every device's updated pieces -> the full parameters on every device."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from zeroshard.layout import Layout, PyTree


def all_gather_params(pieces: Sequence[jax.Array], layout: Layout, axis_name: str) -> PyTree:
    """Gathers every device's pieces into full, replicated parameters.

    One ``all_gather`` per leaf, in the leaf's (compute) dtype: the gathered pieces are
    the leaf itself (a reshape, plus a slice where the leaf was padded), so nothing is
    copied out of a packed buffer. XLA's collective combiners (GPU, TPU) merge small
    gathers again.

    Args:
      pieces: this device's 1-D piece of each leaf (any dtype; cast to the leaf's).
      layout: the parameters' layout.
      axis_name: the mesh axis the rows are spread over.

    Returns:
      The full parameter tree, invariant over ``axis_name`` (usable with ``P()``).
    """
    leaves = []
    for piece, s in zip(pieces, layout.slots, strict=True):
        full = jax.lax.all_gather(piece.astype(s.dtype), axis_name, tiled=True, to="invarying")
        leaves.append(full[: s.size].reshape(s.shape))
    return layout.treedef.unflatten(leaves)
