"""All-gather: every device's updated row -> the full parameters on every device."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from zeroshard.layout import Layout, PyTree


def all_gather_params(rows: Sequence[jax.Array], layout: Layout, axis_name: str) -> PyTree:
    """Gathers the rows of every device into full, replicated parameters.

    One ``all_gather`` per dtype bucket, in the bucket's (compute) dtype.

    Args:
      rows: this device's row of each bucket (any dtype; cast to the bucket's).
      layout: the parameters' layout.
      axis_name: the mesh axis the rows are spread over.

    Returns:
      The full parameter tree, invariant over ``axis_name`` (usable with ``P()``).
    """
    matrices = [
        jax.lax.all_gather(row.astype(b.dtype), axis_name, tiled=False, to="invarying")
        for row, b in zip(rows, layout.buckets, strict=True)
    ]
    return layout.unpack(matrices)
