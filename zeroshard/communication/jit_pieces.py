"""The one-line drop-in's update in the user's own ``jax.jit``, and its stages 2 and 3.

Every ``tx.update`` outside ``shard_map`` runs :func:`apply_in_jit`: one region
manual over the mesh, whatever the stage and wherever the gradient comes from (the
mean gradient, its partial sums, or ``tx.value_and_grad``'s parts). At stages 2 and 3
the gradients, and at stage 3 the weights, are 1/N pieces:

``zs.sharded(inner, stage=3)`` in the user's own ``jax.jit`` step keeps every
parameter 1/N per device, as the pieces the optimizer state keeps (lay them out once
with ``tx.shard_params(params)``): a global array cut over the batch axes along its
first dimension after its stacked layer axes, within its own block over the mesh's
other axes (tensor parallelism's, as the weights' types say on Explicit axes; on a
mesh without them, or on Auto axes, over every axis: :func:`weight_spec`), whose
block on each device, raveled, is exactly its piece (the layout cuts each layer's
raveled values into N equal runs); where the devices do not divide that dimension
(a 50,257-row embedding, a ``(layers, 3, ...)`` fused projection, or, with
``state_bits``, pieces padded to whole blocks of codes), the
:class:`zeroshard.communication.stage3.Piece` of zeroshard's own step, its padded pieces, made
once (:func:`is_padded`; FSDP2 pads each parameter once at init too). So
``tx.update`` runs the stage-3 update where the pieces lie: the gradient's piece in,
the new weights' piece out, no collective. The loss gathers each layer's weights
where it runs (``zs.layer`` around the scan body: :mod:`zeroshard.communication.jit_gather`,
which slices a padded weight back to its shape); a cut parameter read elsewhere
(an embedding) is gathered whole where it is used, by the compiler or by
``zs.gather``, a padded one by ``zs.gather``. At ``stage=2`` the weights stay whole;
the same mark reduces each layer's gradient to its pieces as the backward pass
makes it, and ``tx.update`` all-gathers the new weights.

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
step reduces or gathers with ``jax.grad`` is the compiler's, so ``tx.update`` of its
gradient refuses (at trace time, naming the option): ``quantize_grads``;
``quantize_weights`` at stage 3; ``deterministic``; ``replica_axis``. Given
``tx.value_and_grad``'s gradient, which zeroshard reduced, it takes them. The weights'
pieces are cut over the batch axes major first: a mesh with other axes before them is
refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import all_gathered, axes_of
from zeroshard.communication.stage3 import Piece, is_shard
from zeroshard.core.branches import owned_wholes
from zeroshard.core.layout import PyTree, Slot, Split
from zeroshard.core.mesh import each_laid_out, find_mesh, on_mesh, sharding_of, with_layout
from zeroshard.core.placement import Plan
from zeroshard.core.update import Grads, region
from zeroshard.optimizer.annotations import check_layout
from zeroshard.optimizer.config import kept_apart


def is_padded(slot: Slot) -> bool:
    """Whether stage 3 in the user's ``jax.jit`` keeps the weight of ``slot`` as
    zeroshard's step does, a :class:`zeroshard.communication.stage3.Piece` of its padded pieces:
    where the devices do not divide its first dimension after its layer axes, or the
    blocks of that cut are not its pieces (a layer whose pieces are padded, to whole
    blocks of ``state_bits``' codes say)."""
    k, block = slot.stacked, slot.moved
    if len(slot.shape) <= k or slot.held_shape[k] % block.num_shards:
        return True
    return block.width * block.num_shards != block.size // block.layers


def stays_whole(slot: Slot, mesh: Any) -> bool:
    """Whether stage 3 in the user's ``jax.jit`` on ``mesh`` leaves the weight of
    ``slot`` in its own layout: on Explicit axes, one of one dimension per layer (a
    norm's scale, a bias), which model code reads as it is, with the activations
    (there a weight cut over the batch axes beside activations split over them is a
    sharding type error; on Auto axes the compiler gathers it where it is read).
    They are ``D`` per layer against ``D**2`` for a matrix; DeepSpeed's stage 3 keeps
    small parameters whole likewise (``stage3_param_persistence_threshold``). Their
    state is still 1/N per device."""
    explicit = AxisType.Explicit in getattr(mesh, "axis_types", ())
    return explicit and len(slot.held_shape) - slot.stacked <= 1


def weight_spec(slot: Slot, axis_name: str | tuple[str, ...]) -> P:
    """Where the weight of ``slot`` lies at stage 3: its block (its own split over the
    mesh's other axes, tensor parallelism's) cut over the batch axes (over
    ``axis_name``, every axis of the state, for a leaf of one block) along its first
    dimension after its layer axes, minor to its own split there, so that each
    device's block, raveled, is its piece; where it is :func:`is_padded`, its pieces'
    (:meth:`zeroshard.core.layout.Slot.piece_spec`)."""
    if is_padded(slot):
        return slot.piece_spec(axis_name)
    return slot.cut_spec(axes_of(slot.cut_over(axis_name)))


def _spec(s: Slot, x: object, axis: object, cut: bool, mesh: Any) -> P:
    """The layout of the weight (or gradient) ``x`` of ``s`` in the user's ``jax.jit``:
    a :class:`zeroshard.communication.stage3.Piece`'s pieces; ``cut`` (stage 3's), its block
    (:func:`weight_spec`) where it is not padded; else its own layout (whole)."""
    if is_shard(x):
        return s.piece_spec(axis)
    cut = cut and not is_padded(s) and not stays_whole(s, mesh)
    return weight_spec(s, axis) if cut else s.leaf_spec()


def shard_params(opt: object, params: PyTree) -> PyTree:
    """``params`` laid out as the :class:`zeroshard.optimizer.sharded.Sharded` ``opt`` keeps
    them in the user's ``jax.jit``: at stage 3 each cut as :func:`weight_spec` says, a
    padded one (:func:`is_padded`) made its :class:`zeroshard.communication.stage3.Piece`; else
    whole (its own layout). Arrays placed, traced values constrained,
    ``jax.ShapeDtypeStruct`` leaves given the sharding."""
    opt, plan, mesh = opt.in_jit(params, params, grads=False)
    three, axis, slots = kept_apart(opt.config.stage)[2], opt.config.axis_name, plan.layout.slots

    def place(x: jax.Array, spec: P) -> jax.Array:
        if isinstance(x, jax.ShapeDtypeStruct):  # (to lower a step on abstract values)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        if isinstance(x, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        on = getattr(sharding_of(x), "mesh", None)
        on = on if isinstance(on, Mesh) else mesh  # (a device mesh, else the context's)
        return jax.device_put(x, NamedSharding(on, spec) if isinstance(on, Mesh) else spec)

    def spec(s: Slot, x: object) -> P:  # (at stages 1-2, a weight typed reduced kept so)
        laid = _spec(s, x, axis, three, mesh)
        typed = x.sharding if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x).sharding
        return laid if three else laid.update(reduced=getattr(typed, "spec", P()).reduced)

    leaves = plan.layout.treedef.flatten_up_to(params)
    out = [x if is_shard(x) else place(x, spec(s, x)) for s, x in zip(slots, leaves, strict=True)]
    padded = lambda s, x: three and is_padded(s) and not (is_shard(x) or stays_whole(s, mesh))
    return plan.layout.treedef.unflatten(pieces_of(out, slots, padded, mesh, axis))


def pieces_of(xs: list, slots: tuple, which: Callable, mesh: Mesh, axis: object) -> list:
    """``xs`` (a weight per slot) with each that ``which(slot, x)`` picks made its
    :class:`zeroshard.communication.stage3.Piece`: each device's piece cut out of what it holds (the
    weight whole, or its block over the mesh's other axes), or reshaped from its block
    where it is cut as :func:`weight_spec` says."""
    some = [i for i, (s, x) in enumerate(zip(slots, xs, strict=True)) if which(s, x)]
    given, on = [xs[i] for i in some], [slots[i] for i in some]
    ins = [s.leaf_spec() if is_padded(s) else weight_spec(s, axis) for s in on]
    outs = [s.piece_spec(axis) for s in on]

    def local(xs: list) -> list:
        index = jax.lax.axis_index(axis)
        cuts = [spec != s.leaf_spec() for s, spec in zip(on, ins, strict=True)]
        return [_piece(*a, index).piece for a in zip(xs, on, cuts, strict=True)]

    run = on_mesh(local, mesh, mesh.axis_names, ((ins,), outs), check_vma=mesh.size > 1)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in given):  # (abstract: given the sharding)
        placed = lambda x, spec: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
        )
        made = list(map(placed, jax.eval_shape(run, given), outs))
    elif some:
        made = run(each_laid_out(given, ins, mesh))
    out = [*xs]
    for i, x, s in zip(some, made if some else (), on, strict=True):
        out[i] = Piece(x, s)
    return out


def init_pieces(
    opt: object, plan: Plan, params: PyTree, mesh: Mesh
) -> tuple[list, list[P], Callable]:
    """``tx.init`` at stage 3 in the user's ``jax.jit``: the weights as it reads them
    (a :class:`zeroshard.communication.stage3.Piece`'s pieces, a cut weight's blocks; an owned one
    not padded whole), their layouts, and its function on each device, whose block of
    a weight, raveled, is its piece. No weight is whole on any device (an owned leaf
    is, for its owner), so a model whose weights fit no one device starts."""
    layout, axis = plan.layout, opt.config.axis_name
    leaves = layout.treedef.flatten_up_to(params)
    specs = [
        s.leaf_spec() if s.owned and not is_shard(x) else _spec(s, x, axis, True, mesh)
        for s, x in zip(layout.slots, leaves, strict=True)
    ]
    cut = [spec != s.leaf_spec() for s, spec in zip(layout.slots, specs, strict=True)]

    def local(xs: list, _: None) -> object:
        index = jax.lax.axis_index(axis)  # (a weight given whole: its piece cut from it)
        pieces = [
            _piece(*a, index).piece.reshape(-1) for a in zip(xs, layout.slots, cut, strict=True)
        ]
        wholes = [  # (an owned leaf's, gathered from its pieces where it comes so)
            _block(p, s, False, x, axis) if c and s.owned else x
            for p, s, c, x in zip(pieces, layout.slots, cut, xs, strict=True)
        ]
        pieces = layout.sliced(lambda s, p: p, pieces)
        return opt.init_parts(plan, pieces, owned_wholes(plan, layout.treedef.unflatten(wholes)))

    return [getattr(x, "piece", x) for x in leaves], specs, local


def apply_in_jit(
    opt: object,
    grads: PyTree,
    state: object,
    params: PyTree,
    extra_args: dict,
    splits: Mapping[int, Split] | None = None,
) -> tuple[PyTree, object]:
    """``tx.update``'s new weights and state outside ``shard_map`` (in the user's
    ``jax.jit``, the whole-mesh step's, or eagerly), at every stage: one region
    (:func:`zeroshard.core.update.region`) manual over the mesh, each device updating
    its part of every leaf with its state (split over every device, the drop-in's
    :meth:`zeroshard.optimizer.sharded.Sharded.spanning`). Given ``splits``, the state is
    zeroshard's step's at stage 1 or 2 (its whole-mesh step's): its leaves of ``splits``
    kept block by block, the weights whole, the gradient the mean (default: the
    drop-in's, :meth:`zeroshard.optimizer.sharded.Sharded.typed_splits`). The gradients
    enter as:

    - ``tx.value_and_grad``'s parts (:class:`zeroshard.core.update.Grads`, at any
      stage): as they are;
    - at stage 1, or as partial sums (weights typed ``reduced``: jax's ``unreduced``
      gradients): the mean gradient, reduced by the program that computed it, each
      device cutting its part out of it
      (:class:`zeroshard.communication.arrival.CutMean`), or its partial sums
      reduce-scattered (:class:`zeroshard.communication.arrival.PartialSums`); the new
      weights all-gathered in their own layout;
    - at stages 2 and 3: the mean gradient laid out as stage 3's weights are
      (:func:`_spec`), each device's block its piece; at stage 3 the new weights stay
      pieces, a padded one's :class:`zeroshard.communication.stage3.Piece` (a weight
      given whole, not laid out by :func:`shard_params`, is all-gathered within its
      block), at stage 2 they are all-gathered whole.
    """
    given = isinstance(grads, Grads)  # (tx.value_and_grad's parts, at any stage)
    summed = frozenset() if given else partial_sums(grads)
    cut = not given and splits is None and kept_apart(opt.config.stage)[1] and not summed
    if cut:  # (what the drop-in refuses of jax.grad's gradient, zeroshard reduced it)
        opt, plan, mesh = opt.in_jit(state, params)
    else:
        mesh = find_mesh(opt.config, state, any_axes=True)
        opt, plan = opt.spanned(mesh, params, state.layout, splits)
    opt.check_state(plan, state)
    state_specs = opt.specs_of(plan)
    check_layout(state, state_specs)
    treedef, leaves = plan.layout.treedef, plan.layout.treedef.flatten_up_to(params)
    if given or cut:
        route, cuts, grads, specs, arrive, leave = _pieces(opt, plan, mesh, grads, leaves)
    else:
        route, cuts, grads, specs, arrive, leave = _mean(opt, plan, grads, summed)
    step = region(
        opt,
        plan,
        route,
        mesh,
        (cuts, state_specs, specs, specs),
        arrive,
        leave,
        check_vma=plan.layout.num_shards > 1 and not summed,  # (jax types no sum of sums)
    )
    laid = lambda xs, specs: each_laid_out(xs, specs, mesh)  # (Explicit axes: resharded)
    array = lambda x: getattr(x, "piece", x)
    new, state = step(laid(grads, cuts), state, laid(list(map(array, leaves)), specs), extra_args)
    new = [Piece(n, x.leaf) if is_shard(x) else n for n, x in zip(new, leaves, strict=True)]
    new = treedef.unflatten(new)
    # (the mean path's weights, whole, back in the parameters' own layout)
    return (new if given or cut else with_layout(new, params)), state


def _mean(opt: object, plan: Plan, grads: PyTree, summed: frozenset) -> tuple:
    """The route, the gradients' layouts and leaves, the weights' layouts,
    ``arrive(grads, params)`` and ``leave(new, params)`` of :func:`apply_in_jit` for
    the mean gradient, or its
    partial sums over ``summed``: each leaf typed as its gradient comes (a weight typed
    whole beside ones typed ``reduced``: its mean joins their partial sums as one
    device's, :func:`_one_copy`), the weights whole (a split leaf's block)."""
    slots, treedef = plan.layout.slots, plan.layout.treedef
    grads = treedef.flatten_up_to(grads)
    means = [not unreduced(g) for g in grads]
    typed = lambda kind: [
        s.leaf_spec() if mean else s.leaf_spec().update(**{kind: summed})
        for s, mean in zip(slots, means, strict=True)
    ]
    route = opt.route_of(1, mean=True, summed=summed)  # (the weights whole)

    def arrive(grads: list, params: list) -> tuple:
        grads = _one_copy(grads, means, summed) if summed else grads
        return route.arrival.bring(plan, treedef.unflatten(grads)), treedef.unflatten(params)

    leave = lambda new, params: treedef.flatten_up_to(new)
    return route, typed("unreduced"), grads, typed("reduced"), arrive, leave


def _pieces(opt: object, plan: Plan, mesh: Mesh, grads: Any, leaves: list) -> tuple:
    """The route, the gradients' layouts and leaves, the weights' layouts,
    ``arrive(grads, params)`` and ``leave(new, params)`` of :func:`apply_in_jit` for
    ``tx.value_and_grad``'s parts (any stage) or the mean gradient cut as the pieces
    (stages 2 and 3)."""
    axis, slots, treedef = opt.config.axis_name, plan.layout.slots, plan.layout.treedef
    three = kept_apart(opt.config.stage)[2]  # (the weights as pieces)
    specs = [_spec(s, x, axis, three, mesh) for s, x in zip(slots, leaves, strict=True)]
    kept = [spec != s.leaf_spec() for s, spec in zip(slots, specs, strict=True)]

    def pieces(xs: list, cut: list) -> list:  # (the device's index traced once)
        index = jax.lax.axis_index(axis)
        return [_piece(*a, index).piece for a in zip(xs, slots, cut, strict=True)]

    held = lambda xs: treedef.unflatten(map(Piece, xs, slots))
    weights = lambda params: held(pieces(params, kept)) if three else treedef.unflatten(params)
    if isinstance(grads, Grads):  # (as they came)
        route, cuts, grads = grads.route, grads.specs(plan), grads.parts
        arrive = lambda parts, params: (parts, weights(params))
    else:  # (stage 2: the pieces in, the weights whole out)
        route = opt.route_of(3 if three else 2, mean=True)
        route = route if three else route.held
        grads = treedef.flatten_up_to(grads)
        cuts, grads, arrive = _arriving(plan, route, (axis, mesh), grads, pieces, weights)

    def leave(new: PyTree, params: list) -> list:
        new = [getattr(x, "piece", x) for x in treedef.flatten_up_to(new)]
        if three:  # (a kept weight's block or piece from its piece; a whole one gathered)
            new = [_block(*x, axis) for x in zip(new, slots, kept, params, strict=True)]
        return new

    return route, cuts, grads, specs, arrive, leave


def _arriving(
    plan: Plan, route: Any, on: tuple, grads: list, pieces: Callable, weights: Callable
) -> tuple:
    """The mean gradient's leaves ``grads`` as the drop-in's update region takes them
    ``on`` ``(axis_name, mesh)``: their layouts, the leaves, and ``arrive(grads,
    params)``, each device's parts and the weights as ``weights(params)`` holds them."""
    (axis, mesh), slots, treedef = on, plan.layout.slots, plan.layout.treedef
    # The gradients arrive as stage 3's weights are kept, where they can be (at stage
    # 2 too: zs.layer's backward lays them out so).
    cuts = [_spec(s, g, axis, True, mesh) for s, g in zip(slots, grads, strict=True)]
    cut = [spec != s.leaf_spec() for s, spec in zip(slots, cuts, strict=True)]
    # The gradients cast to the inner optimizer's dtype once, and each device's block
    # of a cut one reshaped to its piece (a bitcast) behind a barrier, before the
    # update. (Cast in the update, the compiler kept two more float32 copies of each
    # stacked gradient alive: 32 layers of capacity.py, 103 MiB of temporaries, not 57
    # on jax 0.12; without the barrier jax 0.10.2 still kept them: 103, not 92. With
    # the barrier before the reshape, jax 0.12 laid the piece out as the update's
    # conditional does not take it, and copied it: 96 MiB, not 57.)
    array = lambda x: getattr(x, "piece", x)
    grads = [
        array(g).astype(plan.inner_dtypes[s.bucket]) for g, s in zip(grads, slots, strict=True)
    ]

    def arrive(grads: list, params: list) -> tuple:
        grads = jax.lax.optimization_barrier(pieces(grads, cut))
        parts = route.arrival.bring(plan, treedef.unflatten(map(Piece, grads, slots)))
        return parts, weights(params)

    return cuts, grads, arrive


def partial_sums(grads: PyTree) -> frozenset[str]:
    """The mesh axes the leaves of ``grads`` that hold partial sums (jax's
    ``unreduced`` type) hold them over, where they all agree; else none. The other
    leaves are the mean already (a weight typed whole: its gradient is reduced)."""
    kinds = {unreduced(g) for g in jax.tree.leaves(grads)} - {frozenset()}
    return kinds.pop() if len(kinds) == 1 else frozenset()


def unreduced(g: Any) -> frozenset[str]:
    """The mesh axes ``g`` holds partial sums over (jax's ``unreduced`` type)."""
    return getattr(getattr(jax.typeof(g), "sharding", None), "spec", P()).unreduced


def _one_copy(grads: list, means: list[bool], axes: frozenset[str]) -> list:
    """``grads`` as partial sums over ``axes``, each leaf ``means`` marks (the mean
    itself, where the others arrive as partial sums: a weight typed whole beside ones
    typed ``reduced``) kept on the first device of ``axes`` and zero on the others:
    its sum over them is that mean, exactly."""
    first = jax.lax.axis_index(tuple(axes)) == 0
    one = lambda g, mean: jnp.where(first, g, jnp.zeros_like(g)) if mean else g
    return list(map(one, grads, means))


def as_pieces(params: PyTree, layout: object, mesh: Mesh, axis: object) -> PyTree:
    """The drop-in's stage-3 weights (:func:`weight_spec`) as zeroshard's step keeps
    them, every leaf a :class:`zeroshard.communication.stage3.Piece` of ``layout``'s records: a
    cut one's block reshaped on each device (no collective)."""
    xs, kept = layout.treedef.flatten_up_to(params), lambda s, x: not is_shard(x)
    return layout.treedef.unflatten(pieces_of(xs, layout.slots, kept, mesh, axis))


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
