"""Stages 2 and 3 of the one-line drop-in: the gradients, and the weights, as 1/N pieces.

``zs.sharded(inner, stage=3)`` in the user's own ``jax.jit`` step keeps every
parameter as a global array cut over the batch axes along its first dimension
after its stacked layer axes, within its own block over the mesh's other axes
(tensor parallelism's, as the weights' types say on Explicit axes; on a mesh
without them, or on Auto axes, over every axis: :func:`weight_spec`; lay them out
once with ``tx.shard_params(params)``). Each device's block, raveled, is exactly the piece of
the leaf that the optimizer state keeps (the layout cuts each layer's raveled values
into N equal runs), so ``tx.update`` runs the stage-3 update where the pieces lie:
the gradient's piece in, the new weights' piece out, no collective. The program still
sees whole parameters; the loss gathers each layer's weights where it runs
(``zs.layer`` around the scan body: :mod:`zeroshard.communication.jit_gather`), and a parameter
read elsewhere (an embedding) is gathered whole where it is used, by the compiler or
by ``zs.gather``. At ``stage=2`` the weights stay whole; the same mark reduces each
layer's gradient to its pieces as the backward pass makes it, and ``tx.update``
all-gathers the new weights.

Why a mark and not the traced loss: in the user's own step ``jax.grad`` is theirs,
and zeroshard never sees the loss to read its gather points. Without the mark the
compiler places the gathers, hoists them out of the scan and keeps the gathered stack
alive (GSPMD FSDP, with any ``jax.checkpoint`` policy); ``zs.layer`` gathers inside
the scan body, gathers again in the backward pass, and ties each gather to its layer.
The numbers are plain optax's either way.

The update is zeroshard's own (:func:`zeroshard.core.update.updated`), so low-bit state
(``state_bits``), the global-norm clip over the pieces and accumulation in the
inner optimizer (``optax.MultiSteps``) work as in zeroshard's step, and stage 2's
all-gather of the new weights carries ``quantize_weights``' codes. What the user's
step reduces or gathers is the compiler's, so this path refuses (at trace time,
naming the option): ``quantize_grads``; ``quantize_weights`` at stage 3;
``deterministic``; ``replica_axis``; a mesh whose batch axes are not its first. A
leaf whose first dimension after its layer axes the N devices do not divide (or,
with ``state_bits``, whose pieces are not whole blocks of codes) is kept whole, as
at stage 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import all_gathered, axes_of
from zeroshard.communication.stage3 import Piece, is_shard
from zeroshard.core.branches import owned_wholes
from zeroshard.core.layout import PyTree, Slot
from zeroshard.core.mesh import each_laid_out
from zeroshard.core.placement import Plan
from zeroshard.core.update import Route, kept_apart, updated


def weight_spec(slot: Slot, axis_name: str | tuple[str, ...]) -> P:
    """Where the weight of ``slot`` lies at stage 3: its block (its own split over the
    mesh's other axes, tensor parallelism's) cut over the batch axes (over
    ``axis_name``, every axis of the state, for a leaf of one block) along its first
    dimension after its layer axes, minor to its own split there, so that each
    device's block, raveled, is its piece; its own layout (whole, as at stage 2) where
    the devices do not divide that dimension or the blocks are not the pieces (a
    layer of a size they do not divide)."""
    k, block = slot.stacked, slot.moved
    if len(slot.shape) <= k or slot.held_shape[k] % block.num_shards:
        return slot.leaf_spec()
    if block.width * block.num_shards != block.size // block.layers:
        return slot.leaf_spec()
    return slot.cut_spec(axes_of(slot.cut_over(axis_name)))


def laid_out(opt: object, plan: Plan) -> list[P]:
    """Each weight's ``PartitionSpec`` as ``opt`` keeps it in the user's ``jax.jit``:
    :func:`weight_spec` at stage 3, else its own layout."""
    three, axis = kept_apart(opt.config.stage)[2], opt.config.axis_name
    return [weight_spec(s, axis) if three else s.leaf_spec() for s in plan.layout.slots]


def shard_params(opt: object, params: PyTree) -> PyTree:
    """``params`` laid out as the :class:`zeroshard.optimizer.sharded.Sharded` ``opt`` keeps
    them in the user's ``jax.jit`` (:func:`laid_out`): arrays placed, traced values
    constrained, ``jax.ShapeDtypeStruct`` leaves given the sharding."""
    opt, plan, mesh = opt.in_jit(params, params)

    def place(x: jax.Array, spec: P) -> jax.Array:
        if isinstance(x, jax.ShapeDtypeStruct):  # (to lower a step on abstract values)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        if isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        on = getattr(getattr(x, "sharding", None), "mesh", None)
        on = on if isinstance(on, Mesh) else mesh  # (a device mesh, else the context's)
        return jax.device_put(x, NamedSharding(on, spec) if isinstance(on, Mesh) else spec)

    leaves = plan.layout.treedef.flatten_up_to(params)
    return plan.layout.treedef.unflatten(map(place, leaves, laid_out(opt, plan)))


def init_pieces(opt: object, plan: Plan) -> tuple[PyTree, Callable]:
    """``tx.init`` at stage 3 in the user's ``jax.jit``: the weights' layout it reads
    (:func:`weight_spec`) and its function on each device, whose block of a weight,
    raveled, is its piece. No weight is whole on any device (an owned leaf is, for
    its owner), so a model whose weights fit no one device starts."""
    layout, axis = plan.layout, opt.config.axis_name
    specs = [s.leaf_spec() if s.owned else weight_spec(s, axis) for s in layout.slots]

    def local(params: PyTree, _: None) -> object:
        index = jax.lax.axis_index(axis)  # (a leaf kept whole: its piece cut from its block)
        piece = lambda s, x, spec: x.reshape(-1) if spec != s.leaf_spec() else s.own(x, index)
        pieces = layout.sliced(piece, layout.treedef.flatten_up_to(params), specs)
        return opt.init_parts(plan, pieces, owned_wholes(plan, params))

    return layout.treedef.unflatten(specs), local


def apply_pieces(
    opt: object, grads: PyTree, state: object, params: PyTree, extra_args: dict
) -> tuple[PyTree, object]:
    """``tx.update``'s new weights and state at stages 2 and 3 in the user's
    ``jax.jit``: one ``shard_map`` manual over the mesh, each device updating its
    pieces of ``grads`` (the mean gradient, laid out as the weights,
    :func:`laid_out`) and of ``params`` with its state. At stage 3 the new weights
    stay pieces (a leaf kept whole is all-gathered within its block); at stage 2 they
    are all-gathered whole."""
    opt, plan, mesh = opt.in_jit(state, params)
    opt.check_state(plan, state)
    axis, slots, treedef = opt.config.axis_name, plan.layout.slots, plan.layout.treedef
    three = kept_apart(opt.config.stage)[2]  # (the weights as pieces)
    route = Route.of(opt.config, 3 if three else 2, mean=True, held=not three)
    # The gradients arrive cut as stage 3's weights are, where they can be (at stage 2
    # too: zs.layer's backward lays them out so), the weights as they are kept.
    cuts, specs = [weight_spec(s, axis) for s in slots], laid_out(opt, plan)
    cut = [spec != s.leaf_spec() for s, spec in zip(slots, cuts, strict=True)]
    # The gradients cast to the inner optimizer's dtype once, and each device's block
    # of a cut one reshaped to its piece (a bitcast) behind a barrier, before the
    # update. (Cast in the update, the compiler kept two more float32 copies of each
    # stacked gradient alive: 32 layers of capacity.py, 103 MiB of temporaries, not 57
    # on jax 0.12; without the barrier jax 0.10.2 still kept them: 103, not 92. With
    # the barrier before the reshape, jax 0.12 laid the piece out as the update's
    # conditional does not take it, and copied it: 96 MiB, not 57.)
    grads = [g.astype(plan.inner_dtypes[s.bucket]) for g, s in _with(grads, plan)]

    def local(grads: list, state: object, params: list, extra_args: dict) -> tuple:
        index = jax.lax.axis_index(axis)
        pieces = lambda xs: [_piece(*a, index).piece for a in zip(xs, slots, cut, strict=True)]
        held = lambda xs: treedef.unflatten(map(Piece, xs, slots))
        grads = jax.lax.optimization_barrier(pieces(grads))
        parts = route.arrival.bring(plan, held(grads))
        whole = held(pieces(params)) if three else treedef.unflatten(params)
        new, state = updated(opt.inner, opt.config, plan, route, parts, state, whole, **extra_args)
        new = [getattr(x, "piece", x) for x in treedef.flatten_up_to(new)]
        if three:  # (a cut weight's block from its piece; a leaf kept whole gathered)
            new = [_block(*x, axis) for x in zip(new, slots, cut, params, strict=True)]
        return new, state

    step = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(cuts, opt.specs_of(plan), specs, P()),
        out_specs=(specs, opt.specs_of(plan)),
        axis_names=set(mesh.axis_names),
        check_vma=plan.layout.num_shards > 1,
    )
    laid = lambda xs, specs: each_laid_out(xs, specs, mesh)  # (Explicit axes: resharded)
    params = laid(treedef.flatten_up_to(params), specs)
    new, state = step(laid(grads, cuts), state, params, extra_args)
    return treedef.unflatten(new), state


def relaid(params: PyTree, mesh: Mesh, axis: object, pieces: PyTree | None = None) -> PyTree:
    """Stage-3 weights of zeroshard's own step (:class:`zeroshard.communication.stage3.Piece`
    leaves, cut over ``axis``) as the drop-in keeps them (:func:`weight_spec`); with
    ``pieces`` (those leaves), the drop-in's ``params`` back as pieces like them. Where
    a device's block is its piece, the same bytes reshaped on each device (no
    collective); a leaf kept whole is gathered within its block, and cut again."""
    leaves, treedef = jax.tree.flatten(params if pieces is None else pieces, is_leaf=is_shard)
    slots = [x.leaf for x in leaves]
    blocks, each = [weight_spec(s, axis) for s in slots], [s.piece_spec(axis) for s in slots]
    cut = [b != s.leaf_spec() for s, b in zip(slots, blocks, strict=True)]
    if pieces is None:
        old = [
            jax.ShapeDtypeStruct(NamedSharding(mesh, b).shard_shape(s.shape), s.dtype)
            for s, b in zip(slots, blocks, strict=True)
        ]
        local = lambda xs: list(map(lambda *a: _block(*a, axis), xs, slots, cut, old))
        xs, ins, outs = [x.piece for x in leaves], each, blocks
    else:
        index = lambda: jax.lax.axis_index(axis)
        local = lambda xs: [_piece(*a, index()).piece for a in zip(xs, slots, cut, strict=True)]
        xs, ins, outs = treedef.flatten_up_to(params), blocks, each
    many = math.prod(mesh.shape.values()) > 1
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(ins,),
        out_specs=outs,
        axis_names=set(mesh.axis_names),
        check_vma=many,
    )(each_laid_out(xs, ins, mesh))
    return treedef.unflatten(out if pieces is None else map(Piece, out, slots))


def _piece(x: jax.Array, s: Slot, cut: bool, index: jax.Array) -> Piece:
    """The device's :class:`zeroshard.communication.stage3.Piece` of a weight from its block ``x``:
    reshaped where the block is the piece (``cut``), else cut out of it."""
    return Piece((x if cut else s.own(x, index)).reshape(s.piece_shape), s)


def _block(piece: jax.Array, s: Slot, cut: bool, old: jax.Array, axis: object) -> jax.Array:
    """The device's block of a weight from its new ``piece``: reshaped as its ``old``
    block where the block is the piece, else gathered over the axes it is cut over."""
    if cut:
        return piece.reshape(old.shape)
    rows = all_gathered(piece.reshape(-1), s.cut_over(axis), to="invarying")
    return s.moved.uncut(rows).astype(old.dtype)


def _with(tree: PyTree, plan: Plan) -> list[tuple[jax.Array, Slot]]:
    """Each leaf of ``tree`` with its record in ``plan``."""
    return list(zip(plan.layout.treedef.flatten_up_to(tree), plan.layout.slots, strict=True))
