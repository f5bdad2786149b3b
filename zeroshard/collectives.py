"""Collectives: when one is the identity and is left out.

The collectives themselves belong to the kinds of arrival (:mod:`zeroshard.arrival`)
and departure (:mod:`zeroshard.departure`) and to stage 3's gather
(:mod:`zeroshard.stage3`). On one device (an axis of size 1, with no varying values)
every collective is the identity and is left out (:func:`is_identity`;
:func:`all_gathered` leaves out its all-gather so).
"""

from __future__ import annotations

from typing import Any

import jax

from zeroshard.layout import PyTree


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


def all_gathered(x: jax.Array, axis_name: str, **kwargs: Any) -> jax.Array:
    """Every device's ``x`` (``(num_shards, ...)``, row ``d`` from device ``d``): one
    ``jax.lax.all_gather`` (with ``kwargs``), or ``x[None]`` where it is the identity."""
    return x[None] if is_identity(x, axis_name) else jax.lax.all_gather(x, axis_name, **kwargs)
