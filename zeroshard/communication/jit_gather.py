"""The gather in the user's own ``jax.jit``: the drop-in's stages 2 and 3.

:func:`zeroshard.layer` and :func:`zeroshard.gather`, called in a plain ``jax.jit``
(no zeroshard step and no ``shard_map`` around them), gather here. Each floating leaf
is made whole on every device right where the layer runs (inside a scan over stacked
layers, this iteration's layer): at ``zs.sharded(inner, stage=3)`` its weights are
global arrays cut 1/N over the batch axes (:mod:`zeroshard.communication.jit_pieces`; over
Explicit axes within a tensor-parallel split, which the gather keeps: it gathers
over the batch axes only), and this is the compiler's all-gather of one layer; a
weight the devices do not cut so is a :class:`zeroshard.communication.stage3.Piece` of padded
pieces, all-gathered in a small ``shard_map`` and sliced back to its shape (zeros
in the padding of its gradient); at stage 2 they are whole already, and it moves
nothing. The ``custom_vjp`` returns
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

import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import all_gathered, axes_of
from zeroshard.core.layout import PyTree, Slot, is_floating
from zeroshard.core.mesh import current_step, keep_axes
from zeroshard.measuring.scopes import GATHER, scope


def in_users_jit() -> bool:
    """Whether a gather runs in the user's own ``jax.jit``: outside any zeroshard step
    and ``shard_map`` (but a step that runs the loss on the whole mesh,
    :mod:`zeroshard.training.whole_mesh`)."""
    step = current_step()
    return not (step and step.gather) and not jax.sharding.get_abstract_mesh().manual_axes


def gather(tree: PyTree, axis_name: str | None, is_piece: Any) -> PyTree:
    """Every floating leaf of ``tree`` whole on every device (see the module); a
    padded weight (``is_piece``: a :class:`zeroshard.communication.stage3.Piece`) from its pieces.

    A leaf whose first dimension ``axis_name`` does not divide is left as it is (the
    compiler gathers it where it is used).

    Arrays on no mesh (one device) are whole already. ``axis_name=None``: every
    axis of the mesh, over which the drop-in cuts its pieces.
    """
    whole = lambda x: _whole(x) if is_piece(x) else _gathered(x, axis_name)
    with scope(GATHER):
        return jax.tree.map(whole, tree, is_leaf=is_piece)


def _whole(x: Any) -> jax.Array:
    """The weight of the :class:`zeroshard.communication.stage3.Piece` ``x`` (of the layer
    it holds), all-gathered from its pieces over the axes they are cut over and sliced back to
    its shape (within its block over the mesh's other axes); the cotangent, reduced
    over the batch already, back to the device's piece."""
    mesh, s = mesh_of(x.piece), x.slot(x.leaf.num_shards, local=False)
    axes = _state_axes(mesh, s, x.piece)
    piece, whole = s.piece_spec(axes), s.leaf_spec()
    run = lambda f, i, o: jax.shard_map(
        f, mesh=mesh, in_specs=(i,), out_specs=o, axis_names=set(mesh.axis_names), check_vma=False
    )
    rows = lambda p: all_gathered(p.reshape(-1), s.cut_over(axes), to="invarying")
    gathered = run(lambda p: s.moved.uncut(rows(p)), piece, whole)
    # (the device's index over the state's axes, the batch's first: not over a replica axis)
    index = lambda: jax.lax.axis_index((*axes_of(s.cut_over(axes)), *s.split.axes))
    cut = run(lambda w: s.own(w, index()).reshape(s.piece_shape), whole, piece)
    whole_x = jax.custom_vjp(gathered)
    whole_x.defvjp(lambda p: (gathered(p), None), lambda _, cotangent: (cut(cotangent),))
    return whole_x(x.piece)


def _state_axes(mesh: Any, s: Slot, piece: Any) -> tuple[str, ...]:
    """The axes of ``mesh`` the pieces of ``s`` (the global array ``piece``) are cut
    over, with their blocks: every axis but a replica axis, which the step running the
    loss on the whole mesh names, on Explicit axes the pieces' type leaves out, and on
    Auto ones an axis whose size leaves the state's ``num_shards`` devices; where
    several do (a replica axis as large as another), the first (a replica axis leads
    the mesh as a rule). Any of them is exact: the gather reads the pieces as one
    global array cut over the axes it names and writes their cotangent so, the same
    values whichever axes those are; axes other than the state's only make the
    compiler move the pieces to them.

    Raises:
      ValueError: for pieces of more or fewer devices than any such axes hold (laid
        out for another mesh).
    """
    step = current_step()
    axes = tuple(a for a in mesh.axis_names if not step or a != step.replica_axis)
    fits = lambda axes: s.split.over or math.prod(mesh.shape[a] for a in axes) == s.num_shards
    if not fits(axes) and not step:
        if _typed(mesh, axes):  # (the axes the pieces' type names)
            named = _named(jax.typeof(piece).sharding.spec)
            fit = [tuple(a for a in axes if a in named)]
        else:  # (Auto: the drop-in's state spans every axis but one)
            fit = [b for b in (tuple(b for b in axes if b != a) for a in axes) if fits(b)]
        axes = fit[0] if fit else axes
    if fits(axes):
        return axes
    raise ValueError(
        f"zeroshard: a stage-3 weight of shape {s.shape} is held as padded pieces of "
        f"{s.num_shards} devices, which no axes of the mesh {dict(mesh.shape)} hold: was "
        "it laid out with tx.shard_params on another mesh? Lay it out on this one."
    )


def _gathered(x: Any, axis_name: str | None) -> Any:
    mesh = mesh_of(x)
    if not is_floating(x) or mesh.empty:  # (on no mesh, one device: whole already)
        return x
    batch = axes_of(axis_name or _default_axes(mesh))
    if not is_cut(x, batch, mesh):
        return x
    if _typed(mesh, batch):  # (its own layout, cut over the batch axes minor to it)
        piece = jax.typeof(x).sharding.spec
        rest = [a for a in mesh.axis_names if a not in batch]
        whole, lay = keep_axes(piece, rest, leading=True), jax.sharding.reshard
        before = lambda x: x
    else:  # (Auto axes: cut over every axis, and gathered whole)
        piece, whole, lay = P(tuple(mesh.axis_names)), P(), jax.lax.with_sharding_constraint
        # (behind a barrier: else the compiler gathers the weight itself, before its
        # layer's tie, once for the forward and the backward pass, and keeps it whole
        # between them; a weight whole already, at stage 2, moves nothing either way)
        before = jax.lax.optimization_barrier
    gathered = lambda x: lay(before(x), NamedSharding(mesh, whole))
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
        return bool(_named(spec) & set(batch))
    return x.ndim > 0 and x.shape[0] % mesh.size == 0


def _named(spec: P) -> set[str]:
    """The mesh axes ``spec`` lays an array out over."""
    return {a for e in spec.partitions if e is not None for a in axes_of(e)}


def _typed(mesh: Any, batch: tuple[str, ...]) -> bool:
    """Whether the ``batch`` axes of ``mesh`` are Explicit: the weights' types say how
    they are cut."""
    return AxisType.Explicit in (mesh.axis_types[mesh.axis_names.index(a)] for a in batch)


def mesh_of(x: Any) -> Any:
    """The mesh ``x`` is laid out on, as its type says; else the mesh in context."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return mesh if mesh is not None and not mesh.empty else jax.sharding.get_abstract_mesh()


def _default_axes(mesh: Any) -> tuple[str, ...]:
    """The batch axes of the step that runs the loss on the whole mesh; else every
    axis of ``mesh``: the drop-in's pieces are cut over the axes of its state, which
    span the mesh. (An optimizer whose ``axis_name`` keeps a tensor-parallel split
    within its blocks: the mark gathers the split too, the same values; naming the
    axis keeps it.)"""
    if step := current_step():
        return axes_of(step.axis_name)
    return tuple(mesh.axis_names)
