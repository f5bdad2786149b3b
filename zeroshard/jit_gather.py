"""The stage-3 gather in the user's own ``jax.jit``: weights that are global arrays cut 1/N.

At ``zs.sharded(inner, stage=3)`` (:mod:`zeroshard.jit_pieces`) every parameter is a
global array split over the batch axis along its first dimension after its stacked
layer axes. To the program it is still the whole parameter; each device holds 1/N of
it. :func:`zeroshard.layer` and :func:`zeroshard.gather`, called in a plain
``jax.jit`` (no zeroshard step and no ``shard_map`` around them), gather such weights
here: one ``all_gather`` per leaf, in a small ``shard_map``, right where the layer
runs (inside a scan over stacked layers, the layer of this iteration). Its
``custom_vjp`` returns the cotangent laid out as the piece: ``jax.grad`` of the mean
loss has reduced it over the batch already, so it is the gradient itself, and the
compiler moves it as all-reduce + slice (or a reduce-scatter, where its passes fuse
the pair). A ``psum_scatter`` there would sum N copies of the reduced gradient: N
times the gradient, silently. Under :func:`zeroshard.layer` the layer's weights are
gathered again in the backward pass instead of being kept.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.layout import PyTree
from zeroshard.mesh import current_step
from zeroshard.scopes import GATHER, scope


def in_users_jit(tree: PyTree, is_piece: Any) -> bool:
    """Whether a gather of ``tree`` runs in the user's own ``jax.jit``: outside any
    zeroshard step and ``shard_map``, on arrays (no zeroshard pieces, ``is_piece``)."""
    if current_step() is not None or jax.sharding.get_abstract_mesh().manual_axes:
        return False
    return not any(map(is_piece, jax.tree.leaves(tree, is_leaf=is_piece)))


def gather(tree: PyTree, axis_name: str | None = None) -> PyTree:
    """Every floating leaf of ``tree`` whole on every device (see the module).

    A leaf whose first dimension ``axis_name`` does not divide is left as it is (the
    compiler gathers it where it is used).

    Raises:
      ValueError: if no mesh is known (the arrays carry none and none is set with
        ``jax.set_mesh``), or ``axis_name`` is ``None`` on a mesh of several axes.
    """
    with scope(GATHER):
        return jax.tree.map(lambda x: _gathered(x, axis_name), tree)


def _gathered(x: Any, axis_name: str | None) -> Any:
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return x
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    mesh = mesh if mesh is not None and not mesh.empty else jax.sharding.get_abstract_mesh()
    axis = axis_name or _only_axis(mesh)
    if x.ndim == 0 or x.shape[0] % mesh.shape[axis]:
        return x
    piece = NamedSharding(mesh, P(axis))
    explicit = mesh.axis_types[mesh.axis_names.index(axis)] == AxisType.Explicit
    all_gather = jax.shard_map(
        lambda p: jax.lax.all_gather(p, axis, tiled=True),
        mesh=mesh,
        in_specs=P(axis),
        out_specs=P(),
        check_vma=False,
    )

    @jax.custom_vjp
    def whole(x: jax.Array) -> jax.Array:
        return all_gather(x)

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        # (reduced over the batch already: the device keeps its piece of it)
        if explicit:
            return (jax.sharding.reshard(cotangent, piece),)
        return (jax.lax.with_sharding_constraint(cotangent, piece),)

    whole.defvjp(lambda x: (all_gather(x), None), backward)
    return whole(x)


def _only_axis(mesh: Any) -> str:
    if mesh.empty:
        raise ValueError(
            "zs.gather / zs.layer in a jax.jit outside any zeroshard step gather the "
            "weights over their mesh, and none is known here: lay the parameters out "
            "with tx.shard_params(params) (zs.sharded(inner, stage=3)), or call under "
            "`with jax.set_mesh(mesh):`."
        )
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"zs.gather / zs.layer in a jax.jit on a mesh of axes {mesh.axis_names}: name "
            "the axis the pieces are cut over, e.g. zs.layer(fn, axis_name='data')."
        )
    return mesh.axis_names[0]
