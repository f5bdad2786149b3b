"""Rows: values of one dtype laid end to end in one array, and taken back out.

Every packed buffer of zeroshard is such a row: the owned leaves' storage
(:class:`zeroshard.core.placement.Storage`), the rows and blocks the owned leaves travel in,
whole or as stage-3 pieces (:meth:`zeroshard.core.layout.Layout.owned_row`,
:meth:`~zeroshard.core.layout.Layout.owned_blocks`,
:func:`zeroshard.communication.stage3.piece_blocks`),
the replicated state gathered after the branches and a stage-3 layer's gathered
pieces. :func:`pack` lays values out (padded
with zeros to a fixed width, so every device's row has one shape); :func:`spans` says
where each value is, and :func:`unpack` takes them back.

Example:
    >>> import jax.numpy as jnp
    >>> row = pack([jnp.ones((2, 2)), jnp.zeros(3)], jnp.float32, width=8)
    >>> row.shape, [x.shape for x in unpack(row, [(2, 2), (3,)])]
    ((8,), [(2, 2), (3,)])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def pack(
    values: Sequence[jax.Array], dtype: Any, width: int | None = None, lead: tuple = ()
) -> jax.Array:
    """``values`` in ``dtype``, end to end along one last axis (each reshaped to
    ``(*lead, -1)``: raveled, or kept as ``lead`` rows), zero-padded to ``width``
    elements (``None``: no padding)."""
    flat = [jnp.reshape(v, (*lead, -1)).astype(dtype) for v in values]
    row = jnp.concatenate([jnp.zeros((*lead, 0), dtype), *flat], axis=-1)
    if width is None:
        return row
    return jnp.pad(row, [(0, 0)] * len(lead) + [(0, width - row.shape[-1])])


def spans(sizes: Sequence[int], start: int = 0) -> list[tuple[int, int]]:
    """``(start, stop)`` of each value of ``sizes`` elements laid end to end."""
    ends = list(itertools.accumulate(sizes, initial=start))
    return list(itertools.pairwise(ends))


def unpack(row: jax.Array, shapes: Sequence[tuple[int, ...]], start: int = 0) -> list[jax.Array]:
    """The values of ``shapes`` laid end to end in ``row`` from ``start`` (the inverse
    of :func:`pack`; over ``row``'s last axis)."""
    lead = row.shape[:-1]
    return [
        row[..., a:b].reshape(*lead, *shape)
        for (a, b), shape in zip(spans([math.prod(s) for s in shapes], start), shapes, strict=True)
    ]
