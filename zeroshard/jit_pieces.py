"""Stages 2 and 3 of the one-line drop-in: the gradients, and the weights, as 1/N pieces.

``zs.sharded(inner, stage=3)`` in the user's own ``jax.jit`` step keeps every
parameter as a global array split over the batch axis along its first dimension
after its stacked layer axes (:func:`weight_spec`; lay them out once with
``tx.shard_params(params)``). Each device's block, raveled, is exactly the piece of
the leaf that the optimizer state keeps (the layout cuts each layer's raveled values
into N equal runs), so ``tx.update`` runs the stage-3 update where the pieces lie:
the gradient's piece in, the new weights' piece out, no collective. The program still
sees whole parameters; the loss gathers each layer's weights where it runs
(``zs.layer`` around the scan body: :mod:`zeroshard.jit_gather`), and a parameter
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

The update is zeroshard's own (:func:`zeroshard.update.updated`), so low-bit state
(``state_bits``), the global-norm clip over the pieces and accumulation in the
inner optimizer (``optax.MultiSteps``) work as in zeroshard's step, and stage 2's
all-gather of the new weights carries ``quantize_weights``' codes. What the user's
step reduces or gathers is the compiler's, so this path refuses (at trace time,
naming the option): ``quantize_grads``; ``quantize_weights`` at stage 3;
``deterministic``; ``replica_axis``; a mesh with a second axis of more than one
device (tensor parallelism). A leaf whose first dimension after its layer axes the
N devices do not divide (or, with ``state_bits``, whose pieces are not whole blocks
of codes) is kept whole, as at stage 2.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.branches import owned_wholes
from zeroshard.layout import PyTree, Slot
from zeroshard.mesh import each_laid_out, with_layout
from zeroshard.placement import Plan
from zeroshard.stage3 import Piece
from zeroshard.update import Route, kept_apart, updated


def weight_spec(slot: Slot, axis_name: str) -> P:
    """Where the weight of ``slot`` lies at stage 3: split over ``axis_name`` along its
    first dimension after its layer axes, so that each device's block, raveled, is its
    piece; ``P()`` (whole, as at stage 2) where the devices do not divide that
    dimension or the blocks are not the pieces (a layer of a size they do not divide)."""
    k, n = slot.stacked, slot.num_shards
    if len(slot.shape) <= k or slot.shape[k] % n or slot.width * n != slot.size // slot.layers:
        return P()
    return P(*(None,) * k, axis_name)


def shard_params(opt: object, params: PyTree) -> PyTree:
    """``params`` laid out as the :class:`zeroshard.sharded.Sharded` ``opt`` keeps
    them in the user's ``jax.jit`` (stage 3: :func:`weight_spec`; below: whole):
    arrays placed, traced values constrained, ``jax.ShapeDtypeStruct`` leaves given
    the sharding."""
    opt, plan, mesh = opt.in_jit(params, params)

    def place(x: jax.Array, spec: P) -> jax.Array:
        if isinstance(x, jax.ShapeDtypeStruct):  # (to lower a step on abstract values)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        if isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        on = getattr(getattr(x, "sharding", None), "mesh", None)  # (a device mesh, not abstract)
        return jax.device_put(x, NamedSharding(on if isinstance(on, Mesh) else mesh, spec))

    three, axis = kept_apart(opt.config.stage)[2], opt.config.axis_name  # (or whole)
    specs = [weight_spec(s, axis) if three else P() for s in plan.layout.slots]
    return plan.layout.treedef.unflatten(
        map(place, plan.layout.treedef.flatten_up_to(params), specs)
    )


def init_pieces(opt: object, plan: Plan, mesh: Mesh) -> tuple[PyTree, Callable]:
    """``tx.init`` at stage 3 in the user's ``jax.jit``: the weights' layout it reads
    (:func:`weight_spec`) and its function on each device, whose block of a weight,
    raveled, is its piece. No weight is whole on any device (an owned leaf is, for
    its owner), so a model whose weights fit no one device starts."""
    opt.config.check_in_jit(mesh, pieces=True)
    layout, axis = plan.layout, opt.config.axis_name
    specs = [P() if s.owned else weight_spec(s, axis) for s in layout.slots]

    def local(params: PyTree, _: None) -> object:
        index = jax.lax.axis_index(axis)  # (a leaf kept whole: its piece cut from it)
        piece = lambda s, x, spec: x.reshape(-1) if spec != P() else s.cut(x, index)
        pieces = layout.sliced(piece, layout.treedef.flatten_up_to(params), specs)
        return opt.init_parts(plan, pieces, owned_wholes(plan, params))

    return layout.treedef.unflatten(specs), local


def apply_pieces(
    opt: object, grads: PyTree, state: object, params: PyTree, extra_args: dict
) -> tuple[PyTree, object]:
    """``tx.update``'s new weights and state at stages 2 and 3 in the user's
    ``jax.jit``: one ``shard_map`` manual over the mesh, each device updating its
    pieces of ``grads`` (the mean gradient, laid out as :func:`weight_spec` says)
    and of ``params`` with its state. At stage 3 the new weights stay pieces; at
    stage 2 they are all-gathered whole."""
    opt, plan, mesh = opt.in_jit(state, params)
    opt.check_state(plan, state)
    axis = opt.config.axis_name
    slots, treedef, n = plan.layout.slots, plan.layout.treedef, plan.layout.num_shards
    three = kept_apart(opt.config.stage)[2]  # (the weights as pieces)
    route = Route.of(opt.config, 3 if three else 2, mean=True, held=not three)
    # Each leaf as the global array of every device's piece, (..., 1, N * width): a
    # reshape that moves no data (the split dimension is the major part of the merged
    # one; a leaf kept whole, raveled and padded, is cut), the gradients cast to the
    # inner optimizer's dtype once, behind a barrier.
    # (Reshaped and cast in the update, the compiler kept two more float32 copies of
    # each stacked gradient alive: 32 layers of capacity.py, 103 MiB of temporaries,
    # not 57 on jax 0.12; without the barrier jax 0.10.2 still kept them: 103, not 92.)
    pieces = [s.piece_spec(axis) for s in slots]
    layer = lambda s: s.size // s.layers

    def wide(x: jax.Array, s: Slot) -> jax.Array:
        if weight_spec(s, axis) == P():
            x = jnp.pad(x.reshape(s.layers, -1), ((0, 0), (0, n * s.width - layer(s))))
        return reshaped(x, (*s.piece_shape[:-1], n * s.width), s.piece_spec(axis), mesh)

    def narrow(x: jax.Array, s: Slot) -> jax.Array:  # (wide's inverse)
        if (spec := weight_spec(s, axis)) == P():
            x = with_layout(x, NamedSharding(mesh, P())).reshape(s.layers, -1)[:, : layer(s)]
        return reshaped(x, s.shape, spec, mesh)

    grads = [wide(g, s).astype(plan.inner_dtypes[s.bucket]) for g, s in _with(grads, plan)]
    grads = jax.lax.optimization_barrier(grads)
    params = [wide(x, s) if three else x for x, s in _with(params, plan)]
    weights = pieces if three else treedef.flatten_up_to(plan.layout.leaf_specs())

    def local(grads: list, state: object, params: list, extra_args: dict) -> tuple:
        held = lambda xs: treedef.unflatten(map(Piece, xs, slots))
        parts = route.arrival.bring(plan, held(grads))
        whole = held(params) if three else treedef.unflatten(params)
        new, state = updated(opt.inner, opt.config, plan, route, parts, state, whole, **extra_args)
        return [getattr(x, "piece", x) for x in treedef.flatten_up_to(new)], state

    step = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(pieces, opt.specs_of(plan), weights, P()),
        out_specs=(weights, opt.specs_of(plan)),
        axis_names=set(mesh.axis_names),
        check_vma=n > 1,
    )
    laid = lambda xs, specs: each_laid_out(xs, specs, mesh)  # (Explicit axes: resharded)
    new, state = step(laid(grads, pieces), state, laid(params, weights), extra_args)
    if three:
        new = [narrow(x, s) for x, s in zip(new, slots, strict=True)]
    return treedef.unflatten(new), state


def reshaped(x: jax.Array, shape: tuple[int, ...], spec: P, mesh: object) -> jax.Array:
    """``x`` reshaped to ``shape``, laid out as ``spec`` (over Explicit axes jax asks
    for the layout of a reshape that merges a split dimension)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, spec))
    return x.reshape(shape)


def _with(tree: PyTree, plan: Plan) -> list[tuple[jax.Array, Slot]]:
    """Each leaf of ``tree`` with its record in ``plan``."""
    return list(zip(plan.layout.treedef.flatten_up_to(tree), plan.layout.slots, strict=True))
