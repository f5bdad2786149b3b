"""Held: stage 2 for a loss that gathers, its gradients reduce-scattered layer by layer.

Stage 2 keeps the weights whole and replicated and the gradients 1/N. Given a loss
that uses the parameters directly, its backward pass makes the full gradient of every
leaf (for stacked layers scanned over: of every layer) before the step
reduce-scatters it, so without accumulation it holds what stage 1 holds.

When the loss reads every parameter only through :func:`zeroshard.gather` or
:func:`zeroshard.layer` (as a stage-3 loss must), the step reads that from the loss
traced once (:func:`zeroshard.analysis.reads.reads_only_gathered`) and hands it
:class:`zeroshard.communication.stage3.Held` leaves instead: this device's piece of each parameter
(laid out as stage 3's) and the whole replicated parameter. Their gather returns the
whole parameter with no collective, and its transpose is the stage-3 gather's: each
gathered layer's gradient is reduce-scattered onto the piece as soon as the backward
pass has made it (exactly, quantized or in fixed order, as the step's
:attr:`zeroshard.core.update.Route.gather`). The step differentiates with respect to the
pieces only, so the gradients arrive as stage 3's do
(:class:`zeroshard.communication.arrival.Pieces`) and the new weights leave all-gathered,
as in stage 2 (:class:`zeroshard.communication.departure.AllGather`).
A loss that reads a parameter any other way runs the plain stage-2 step, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from zeroshard.communication.collectives import to_bits
from zeroshard.communication.stage3 import Held, Piece, is_shard
from zeroshard.core.layout import Layout, PyTree


def pieces_of(layout: Layout, params: PyTree, axis_name: str, dtype: Any = None) -> PyTree:
    """This device's piece of every leaf of the whole ``params``, as stage-3
    :class:`zeroshard.Piece` pieces laid out by ``layout`` (owned leaves too), in
    ``dtype`` (``None``: the parameters'): what a held step differentiates."""
    index = jax.lax.axis_index(axis_name)
    leaves = layout.treedef.flatten_up_to(params)
    return layout.treedef.unflatten(
        Piece(s.cut(x, index).astype(dtype or x.dtype).reshape(s.piece_shape), s)
        for x, s in zip(leaves, layout.slots, strict=True)
    )


def value_and_grad(loss: Callable[..., Any], params: PyTree) -> Callable[..., Any]:
    """``(out, grads) = f(pieces, batch, key, model_state)``: ``loss`` (the step's
    convention, with aux) on :class:`zeroshard.communication.stage3.Held` leaves of ``pieces`` (from
    :func:`pieces_of`) and the whole ``params``, differentiated with respect to the
    pieces only: ``grads`` are :class:`zeroshard.Piece` pieces, summed over the axis
    by the gathers' transposes."""

    def on_pieces(pieces: PyTree, *args: Any) -> Any:
        hold = lambda p, x: Held(p.piece, to_bits(x), p.leaf)
        return loss(jax.tree.map(hold, pieces, params, is_leaf=is_shard), *args)

    return jax.value_and_grad(on_pieces, has_aux=True)
