"""Sums: the inner update evaluated with its global sums made global.

Where the traced update combines several leaves' sums over this device's elements in
a non-linear way (a global norm, as ``optax.clip_by_global_norm`` computes), the
analysis of :mod:`zeroshard.analysis` marks it; :func:`run_with_sums` then evaluates
the update's jaxpr equation by equation, with a ``psum`` over the sharding axis
inserted on those partial sums, so every device uses the norm over all parameters.
"""

from __future__ import annotations

from typing import Any

import jax

from zeroshard.analysis import Tag, Tagger


def run_with_sums(
    fn: Any, args: tuple, in_tags: list[Tag], axis_name: str, leaf_names: list[str]
) -> Any:
    """``fn(*args)``, evaluated from its jaxpr with each global sum over several leaves
    summed over ``axis_name`` where it meets a non-linear operation (see
    :class:`zeroshard.analysis.Tagger`)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    _, values = Tagger(axis_name, leaf_names).run(closed, in_tags, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), values)
