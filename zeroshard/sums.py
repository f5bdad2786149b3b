"""Sums: the inner update evaluated with its sums made whole.

Where the traced update uses a sum over this device's elements in a non-linear way (a
leaf's norm, as LAMB's and LARS's trust ratios need; an RMS, as Adafactor's update
clipping; a global norm over several leaves, as ``optax.clip_by_global_norm``), the
analysis of :mod:`zeroshard.analysis` marks it; :func:`run_with_sums` then evaluates
the update's jaxpr equation by equation, with a ``psum`` over the sharding axis
inserted on those partial sums, so every device uses the sum over whole leaves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from zeroshard.analysis import Tag, Tagger
from zeroshard.layout import Slot


def run_with_sums(
    fn: Any,
    args: tuple,
    in_tags: list[Tag],
    axis_name: str,
    leaf_names: list[str],
    sliced: Mapping[int, Slot],
) -> Any:
    """``fn(*args)``, evaluated from its jaxpr with each sum over the elements of the
    ``sliced`` leaves (this device's pieces) made the sum over the whole leaf where it
    meets a non-linear operation: summed over ``axis_name``, padding left out, a mean
    divided by the leaf's size (see :class:`zeroshard.analysis.Tagger`)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    tagger = Tagger(axis_name, leaf_names, sliced)
    _, values = tagger.run(closed, in_tags, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shape), values)
