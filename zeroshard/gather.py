"""Stage 3: weights kept as 1/N pieces, gathered layer by layer just before use.

In a stage-3 :class:`zeroshard.TrainState` every parameter is a :class:`Shard`: this
device's piece of the raveled leaf (the same piece the optimizer state uses), plus the
leaf's full shape and dtype as static data. A loss function calls :func:`gather` on
one layer's parameters right before the layer. That is one ``all_gather`` per dtype
for the whole layer. Autodiff transposes the all-gather into a reduce-scatter, so the
gradient of each piece arrives already reduced (summed over devices). Wrap a layer in
:func:`layer` so its gathered weights are recomputed in the backward pass instead of
saved. Then no device ever holds all the weights at once.

Example:
    >>> import jax.numpy as jnp, zeroshard as zs
    >>> def loss_fn(params, batch):          # params: a tree of zs.Shard (stage 3)
    ...     x = batch["x"]
    ...     for p in params["layers"]:
    ...         x = zs.layer(lambda w, x: jnp.tanh(x @ w["w"] + w["b"]))(p, x)
    ...     return jnp.mean((x - batch["y"]) ** 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroshard.layout import PyTree


@jax.tree_util.register_pytree_node_class
class Shard:
    """This device's piece of a parameter, with the parameter's full shape and dtype.

    Attributes:
      piece: the piece, shaped ``(1, ..., 1, ceil(size / N))`` on a device (inside
        ``shard_map``); outside, the global array of all pieces.
      shape: the parameter's full shape (static).
      dtype: the parameter's dtype (static).
    """

    def __init__(self, piece: Any, shape: tuple[int, ...], dtype: Any):
        self.piece, self.shape, self.dtype = piece, tuple(shape), np.dtype(dtype)

    def tree_flatten(self):
        return (self.piece,), (self.shape, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __jax_array__(self):
        raise TypeError(
            f"a stage-3 parameter of shape {self.shape} is only this device's piece: call "
            "zs.gather(layer_params) (or wrap the layer in zs.layer) before using it."
        )

    def __repr__(self) -> str:
        piece = getattr(self.piece, "shape", self.piece)
        return f"Shard(shape={self.shape}, dtype={self.dtype.name}, piece={piece})"


def is_shard(x: Any) -> bool:
    return isinstance(x, Shard)


def full_structs(params: PyTree) -> PyTree:
    """``ShapeDtypeStruct`` of the full parameters (``Shard`` leaves or arrays)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params, is_leaf=is_shard)


def gather(tree: PyTree, axis_name: str = "data") -> PyTree:
    """Replaces every :class:`Shard` in ``tree`` by the full parameter.

    One ``all_gather`` per dtype for the whole tree (call it once per layer), in the
    parameters' dtype. Inside ``shard_map`` over ``axis_name`` only.

    Args:
      tree: a pytree whose leaves are ``Shard`` (other leaves pass through).
      axis_name: the axis the pieces are spread over.

    Returns:
      The same tree with full arrays for the shards. Differentiating through it
      reduce-scatters the cotangents back onto the pieces.
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    shards = [i for i, x in enumerate(leaves) if is_shard(x)]
    out = list(leaves)
    for dtype in dict.fromkeys(leaves[i].dtype for i in shards):
        group = [i for i in shards if leaves[i].dtype == dtype]
        pieces = [jnp.ravel(leaves[i].piece).astype(dtype) for i in group]
        rows = jax.lax.all_gather(jnp.concatenate(pieces), axis_name)  # (N, sum of pieces)
        offset = 0
        for i, piece in zip(group, pieces, strict=True):
            block = rows[:, offset : offset + piece.size]
            shape = leaves[i].shape
            out[i] = block.reshape(-1)[: math.prod(shape)].reshape(shape)
            offset += piece.size
    return treedef.unflatten(out)


def layer(fn: Callable[..., Any], axis_name: str = "data") -> Callable[..., Any]:
    """``fn(gather(params), *args)``, with the weights gathered again in the backward pass.

    Args:
      fn: ``fn(full_params, *args)``: one layer's computation.
      axis_name: the axis the pieces are spread over.

    Returns:
      ``wrapped(params, *args)`` taking the layer's ``Shard`` tree. Only the pieces
      and ``args`` are kept for the backward pass. That pass gathers the weights again
      and differentiates ``fn``: the stage-3 trade of memory for bandwidth.
    """

    def run(params: PyTree, *args: Any) -> Any:
        return fn(gather(params, axis_name), *args)

    @jax.custom_vjp
    def wrapped(params: PyTree, *args: Any) -> Any:
        return run(_after(params, args), *args)

    def forward(params: PyTree, *args: Any) -> tuple[Any, tuple[PyTree, tuple]]:
        return run(_after(params, args), *args), (params, args)

    def backward(residuals: tuple[PyTree, tuple], cotangent: Any) -> tuple:
        params, args = residuals
        _, vjp = jax.vjp(run, _after(params, cotangent), *args)
        grads, *arg_grads = vjp(cotangent)
        # The cotangents flowing on to earlier layers wait for this layer's weight
        # gradients, so each layer's full-size gradient is reduce-scattered (and freed)
        # before the next one is made.
        return (grads, *_after(tuple(arg_grads), grads))

    wrapped.defvjp(forward, backward)
    return wrapped


def _after(tree: PyTree, anchor: PyTree) -> PyTree:
    """``tree`` plus an exact zero computed from ``anchor``: the same values, but a data
    dependency the compiler must respect. It orders the gathers of stage 3 layer by
    layer (a gather can neither run before its layer is reached, nor be merged with its
    forward twin, which would keep every layer's weights alive until the backward)."""
    leaves = [x for x in jax.tree.leaves(anchor) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return tree
    zero = 0 * jnp.ravel(leaves[0])[0]

    def tie(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return x + zero.astype(jnp.result_type(x))
        return x

    return jax.tree.map(tie, tree)
