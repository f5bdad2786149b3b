"""The gather in the user's own ``jax.jit``: the drop-in's stages 2 and 3.

:func:`zeroshard.layer` and :func:`zeroshard.gather`, called in a plain ``jax.jit``
(no zeroshard step and no ``shard_map`` around them), gather here. Each floating leaf
is made whole on every device right where the layer runs (inside a scan over stacked
layers, this iteration's layer): at ``zs.sharded(inner, stage=3)`` its weights are
global arrays cut 1/N over the batch axes (:mod:`zeroshard.communication.jit_pieces`; over
Explicit axes within a tensor-parallel split, which the gather keeps: it gathers
over the batch axes only), and this is the compiler's all-gather of one layer; at
stage 2 they are whole already, and it moves nothing. The ``custom_vjp`` returns
the cotangent laid out as the piece:
``jax.grad`` of the mean loss has reduced it over the batch already, so it is the
gradient itself, and the compiler moves it as all-reduce + slice (or a
reduce-scatter, where its passes fuse the pair) as the backward pass makes each
layer's (over Explicit axes a whole weight's type is whole, and so must its
cotangent's be: there stage 2's gradients stay whole until the update). A
``psum_scatter`` there would sum N copies of the reduced gradient: N times
the gradient, silently. Under :func:`zeroshard.layer` each layer's weights are
gathered again in the backward pass instead of being kept, and each gather is tied to
its layer's input, so the compiler can neither hoist it out of the scan nor keep it.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import axes_of
from zeroshard.core.layout import PyTree, is_floating
from zeroshard.core.mesh import current_step, keep_axes
from zeroshard.measuring.scopes import GATHER, scope


def in_users_jit(tree: PyTree, is_piece: Any) -> bool:
    """Whether a gather of ``tree`` runs in the user's own ``jax.jit``: outside any
    zeroshard step and ``shard_map`` (but a step that runs the loss on the whole mesh,
    :mod:`zeroshard.training.whole_mesh`), on arrays (no zeroshard pieces, ``is_piece``)."""
    step = current_step()
    if (step and step.gather) or jax.sharding.get_abstract_mesh().manual_axes:
        return False
    return not any(map(is_piece, jax.tree.leaves(tree, is_leaf=is_piece)))


def gather(tree: PyTree, axis_name: str | None = None) -> PyTree:
    """Every floating leaf of ``tree`` whole on every device (see the module).

    A leaf whose first dimension ``axis_name`` does not divide is left as it is (the
    compiler gathers it where it is used).

    Arrays on no mesh (one device) are whole already.

    Raises:
      ValueError: if ``axis_name`` is ``None`` on a mesh of several axes.
    """
    with scope(GATHER):
        return jax.tree.map(lambda x: _gathered(x, axis_name), tree)


def _gathered(x: Any, axis_name: str | None) -> Any:
    mesh = mesh_of(x)
    if not is_floating(x) or mesh.empty:  # (on no mesh, one device: whole already)
        return x
    batch = axes_of(axis_name or _only_axis(mesh))
    if not is_cut(x, batch, mesh):
        return x
    if _typed(mesh, batch):  # (its own layout, cut over the batch axes minor to it)
        piece = jax.typeof(x).sharding.spec
        rest = [a for a in mesh.axis_names if a not in batch]
        whole, lay = keep_axes(piece, rest, leading=True), jax.sharding.reshard
    else:  # (Auto axes: cut over every axis, and gathered whole)
        piece, whole, lay = P(tuple(mesh.axis_names)), P(), jax.lax.with_sharding_constraint
    gathered = lambda x: lay(x, NamedSharding(mesh, whole))
    # (the cotangent is reduced over the batch already: the device keeps its piece)
    keep = lambda _, cotangent: (lay(cotangent, NamedSharding(mesh, piece)),)
    whole_x = jax.custom_vjp(gathered)
    whole_x.defvjp(lambda x: (gathered(x), None), keep)
    return whole_x(x)


def is_cut(x: Any, batch: tuple[str, ...], mesh: Any) -> bool:
    """Whether the weight ``x`` on ``mesh`` is the drop-in's piece, cut over the
    ``batch`` axes: as its type says on Explicit axes (whole in its type, its cotangent
    must be whole too); on Auto ones, where the devices divide its first dimension
    (:func:`zeroshard.communication.jit_pieces.weight_spec` cuts it so)."""
    if _typed(mesh, batch):
        spec = jax.typeof(x).sharding.spec
        return any(a in batch for e in spec.partitions if e is not None for a in axes_of(e))
    return x.ndim > 0 and x.shape[0] % mesh.size == 0


def _typed(mesh: Any, batch: tuple[str, ...]) -> bool:
    """Whether the ``batch`` axes of ``mesh`` are Explicit: the weights' types say how
    they are cut."""
    return AxisType.Explicit in (mesh.axis_types[mesh.axis_names.index(a)] for a in batch)


def mesh_of(x: Any) -> Any:
    """The mesh ``x`` is laid out on, as its type says; else the mesh in context."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return mesh if mesh is not None and not mesh.empty else jax.sharding.get_abstract_mesh()


def _only_axis(mesh: Any) -> tuple[str, ...]:
    """The batch axes of the step that runs the loss on the whole mesh; else every
    axis of ``mesh``, which the drop-in cuts its pieces over, where one at most has
    more than one device."""
    if step := current_step():
        return axes_of(step.axis_name)
    if sum(n > 1 for n in mesh.shape.values()) > 1:
        raise ValueError(
            f"zs.gather / zs.layer in a jax.jit on a mesh of axes {mesh.axis_names}: name "
            "the axis the pieces are cut over, e.g. zs.layer(fn, axis_name='data')."
        )
    return tuple(mesh.axis_names)
