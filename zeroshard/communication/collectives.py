"""Comm: the collectives zeroshard runs, and when one is the identity and is left out.

The collectives themselves belong to the kinds of arrival (:mod:`zeroshard.communication.arrival`)
and departure (:mod:`zeroshard.communication.departure`) and to stage 3's gather
(:mod:`zeroshard.communication.stage3`). On one device (an axis of size 1, with no varying values)
every collective is the identity and is left out (:func:`is_identity`;
:func:`all_gathered` leaves out its all-gather so), and a list of parts is packed
into one collective (:func:`all_gathered_parts`, :func:`summed_parts`). 16-bit floats
are moved as their bits (:func:`to_bits`), exactly, at their own width on every backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.core.layout import PyTree
from zeroshard.core.rows import spans


def axes_of(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    """``axis_name`` (one mesh axis or a tuple of them) as a tuple."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def mesh_size(mesh: Any, axis_name: str | tuple[str, ...]) -> int:
    """The number of devices of ``mesh`` along ``axis_name`` (the product, for several)."""
    return math.prod(mesh.shape[a] for a in axes_of(axis_name))


def axis_env(axis_name: str | tuple[str, ...], size: int) -> list[tuple[str, int]]:
    """``jax.make_jaxpr``'s ``axis_env`` binding ``axis_name`` to ``size`` devices (for
    several axes: the first holds them all, the others one each; a collective over the
    tuple sees ``size`` either way)."""
    return [(a, size if k == 0 else 1) for k, a in enumerate(axes_of(axis_name))]


def varying_axes(x: Any) -> frozenset:
    """The manual axes ``x`` (an array, a tracer or a jaxpr variable) is typed as
    varying over; none for a value outside ``shard_map``."""
    aval = getattr(x, "aval", None)
    try:
        return (aval or jax.typeof(x)).manual_axis_type.varying
    except (AttributeError, TypeError):
        return frozenset()


def varies(x: Any, axes: str | tuple[str, ...]) -> bool:
    """Whether ``x`` is typed varying over every one of ``axes``."""
    return set(axes_of(axes)) <= varying_axes(x)


def vary(x: Any, axes: str | tuple[str, ...]) -> jax.Array:
    """``x`` typed varying over ``axes`` (a cast, over those it does not vary over yet;
    no data moves)."""
    missing = tuple(a for a in axes_of(axes) if a not in varying_axes(x))
    return jax.lax.pcast(jnp.asarray(x), missing, to="varying") if missing else x


def is_identity(x: PyTree, axes: str | tuple[str, ...]) -> bool:
    """Whether a collective of ``x`` over ``axes`` is the identity and can be left out:
    the axes hold one device and no leaf of ``x`` is typed as varying over them (in a
    ``shard_map`` with ``check_vma=False``, or on invariant values). Where a leaf is
    varying, only the collective makes it invariant, so it stays."""
    if any(jax.lax.axis_size(a) != 1 for a in axes_of(axes)):
        return False
    return not any(varying_axes(leaf) & set(axes_of(axes)) for leaf in jax.tree.leaves(x))


def all_gathered(x: jax.Array, axis_name: str, **kwargs: Any) -> jax.Array:
    """Every device's ``x`` (``(num_shards, ...)``, row ``d`` from device ``d``): one
    ``jax.lax.all_gather`` (with ``kwargs``), or ``x[None]`` where it is the identity."""
    return x[None] if is_identity(x, axis_name) else jax.lax.all_gather(x, axis_name, **kwargs)


def all_gathered_parts(parts: Sequence[jax.Array], axis_name: str, **kwargs: Any) -> list:
    """Every device's 1-D ``parts``, packed into one :func:`all_gathered` (with
    ``kwargs``): one ``(num_shards, width)`` per part, row ``d`` from device ``d``."""
    full = all_gathered(jnp.concatenate(parts), axis_name, **kwargs)
    # (split, not sliced: its transpose concatenates the gradients, where each slice's
    # transpose pads its part to the whole and the pads are summed)
    return jnp.split(full, [b for _, b in spans([p.shape[0] for p in parts])][:-1], axis=1)


def summed_parts(blocks: Sequence[jax.Array], axis_name: str, over: int = 1) -> list:
    """This device's row of the sum over ``axis_name`` of each of ``blocks`` (each
    ``(num_shards, width)``, row ``d`` for device ``d``), divided by ``over`` (the
    number of devices: the mean): one ``psum_scatter`` of them packed, its row divided
    once (dividing each part instead compiled to other bits at N = 3)."""
    matrix = jnp.concatenate(blocks, 1)
    row = jax.lax.psum_scatter(matrix, axis_name, scatter_dimension=0, tiled=True)[0]
    row = row if over == 1 else row / over
    return [row[a:b] for a, b in spans([x.shape[1] for x in blocks])]


def to_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as its bits (``uint16``); other arrays as they are: how
    16-bit weights are all-gathered (:class:`zeroshard.communication.departure.AllGather`) and how a
    :class:`zeroshard.communication.stage3.Held` leaf carries them through a loop over its layers.
    Moving bits is exact; XLA's CPU backend moves 16-bit floats widened to float32
    (an all-gather's result twice its size; a loop over the layers of a stacked leaf
    widens them all before it starts, 4 bytes per parameter)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of :func:`to_bits` for an array of ``dtype``."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x
