"""Logical layout: a sharded ``TrainState`` <-> plain optax's state for the full params.

The *logical* form of a training state is what a plain optax run would hold: the
parameters in the master dtype (fp32 master weights, or the parameters themselves
where they are already fp32) and the inner optimizer's state with the same tree
structure and leaf shapes as ``inner.init(params)``. It does not depend on the
device count, which is what makes checkpoints restorable on any mesh and lets a
run move between plain optax and zeroshard.

The conversion runs inside ``shard_map``. Logical leaves are split over the axis along
their first dimension that divides by N, so each device holds (and a checkpoint
writes) its own block. When that is the first dimension, a device's piece of the
raveled leaf *is* its block of rows: a local reshape, no communication. Otherwise the
leaf is gathered, one leaf at a time, and each device keeps its block; leaves with no
dimension divisible by N (small ones, typically) stay replicated.

Example:
    >>> import jax, jax.numpy as jnp, optax, zeroshard as zs
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = zs.sharded(optax.adam(1e-3), axis_name="data")
    >>> state = zs.init_train_state({"w": jnp.ones((8, 3))}, tx, mesh)
    >>> params, opt_state = zs.to_optax_state(state, tx)
    >>> opt_state[0].mu["w"].shape  # as optax.adam(1e-3).init(params)
    (8, 3)
    >>> state = zs.from_optax_state(params, opt_state, tx, mesh, step=7)
    >>> int(state.step)
    7
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import axes_of, vary
from zeroshard.communication.departure import departure_of
from zeroshard.communication.jit_pieces import as_pieces
from zeroshard.communication.stage3 import is_shard, to_shards
from zeroshard.core.branches import init_parts, owned_wholes
from zeroshard.core.layout import PyTree, Slot, is_floating
from zeroshard.core.mesh import (
    check_mesh,
    each_laid_out,
    mesh_of,
    on_mesh,
    run_on_mesh,
)
from zeroshard.core.placement import Key, Plan
from zeroshard.core.state_kinds import BlockedState, OwnedState, SlicedState
from zeroshard.core.state_layout import StateLayout, layout_of_state, state_layout
from zeroshard.core.update import master_pieces
from zeroshard.optimizer.config import kept_apart
from zeroshard.optimizer.loss_scale import LossScaleState
from zeroshard.optimizer.sharded import ShardedTransformation, optimizer_of
from zeroshard.optimizer.state import LayoutKey, ShardedState, TrainState, key_of
from zeroshard.training.step import laid_out_as

__all__ = ["from_optax_state", "logical_spec", "logical_structs", "mesh_of", "to_optax_state"]


def logical_dim(shape: tuple[int, ...], num_shards: int) -> int | None:
    """The first dimension of a logical leaf that divides by ``num_shards``, if any."""
    return next((k for k, d in enumerate(shape) if d > 0 and d % num_shards == 0), None)


def logical_spec(shape: tuple[int, ...], num_shards: int, axis_name: str) -> P:
    """Splits a logical leaf's first dimension that divides by ``num_shards``; else
    replicates it."""
    k = logical_dim(shape, num_shards)
    return P() if k is None else P(*(None,) * k, axis_name)


def logical_gather(block: jax.Array, shape: tuple[int, ...], axis_name: str) -> jax.Array:
    """The full logical leaf of ``shape`` from this device's block of it."""
    k = logical_dim(shape, jax.lax.axis_size(axis_name))
    if k is None:
        return block
    return jax.lax.all_gather(block, axis_name, axis=k, tiled=True, to="invarying")


def logical_block(full: jax.Array, axis_name: str) -> jax.Array:
    """This device's block of a full logical leaf (all of it if no dimension divides)."""
    k = logical_dim(full.shape, jax.lax.axis_size(axis_name))
    return full if k is None else _block_along(full, k, axis_name)


def _block_along(full: jax.Array, dim: int, axis_name: str) -> jax.Array:
    """This device's block of ``full`` along dimension ``dim``."""
    size = full.shape[dim] // jax.lax.axis_size(axis_name)
    start = jax.lax.axis_index(axis_name) * size
    return jax.lax.dynamic_slice_in_dim(full, start, size, dim, allow_negative_indices=False)


def to_logical(slot: Slot, piece: jax.Array, axis_name: str) -> jax.Array:
    """This device's piece of a sliced leaf -> its block of the logical leaf (inside
    ``shard_map``).

    Split along the first dimension, a sliced leaf's piece *is* the device's block
    of rows: a local reshape. Otherwise the leaf is gathered (one leaf at a time)
    and the device keeps its block, or all of it when no dimension divides.
    """
    n, shape = slot.num_shards, slot.shape
    if _rows(slot):
        return piece.reshape((shape[0] // n, *shape[1:]))
    # (typed varying over every axis it is gathered over: jax 0.12.1 refuses a gather
    # of a piece that is invariant over one of them, e.g. under deterministic=)
    piece = vary(piece.reshape(-1), axis_name)
    full = slot.uncut(jax.lax.all_gather(piece, axis_name, to="invarying"))
    return logical_block(full, axis_name)


def from_logical(slot: Slot, block: jax.Array, axis_name: str) -> jax.Array:
    """This device's block of the logical leaf -> its piece, shaped ``slot.piece_shape``."""
    if _rows(slot):
        return block.reshape(slot.piece_shape)
    full = logical_gather(block, slot.shape, axis_name)
    return slot.cut(full, jax.lax.axis_index(axis_name)).reshape(slot.piece_shape)


def _rows(slot: Slot) -> bool:
    """Whether a sliced leaf's piece is a block of its rows (its first dimension
    divides by the device count, and the leaf is not padded)."""
    n, whole = slot.num_shards, slot.split.blocks == 1 and not slot.stacked
    return whole and logical_dim(slot.shape, n) == 0 and slot.piece_size * n == slot.size


def blocks_to_logical(block: jax.Array, dim: int, axis_name: str) -> jax.Array:
    """This device's block (along ``dim``) of a leaf kept as blocks (see
    :class:`zeroshard.core.state_kinds.BlockedState`) -> its block of the logical leaf:
    the same where ``dim`` is the logical one; else gathered and cut again."""
    n = jax.lax.axis_size(axis_name)
    shape = (*block.shape[:dim], block.shape[dim] * n, *block.shape[dim + 1 :])
    if logical_dim(shape, n) == dim:
        return block
    full = jax.lax.all_gather(block, axis_name, axis=dim, tiled=True, to="invarying")
    return logical_block(full, axis_name)


def blocks_from_logical(
    block: jax.Array, shape: tuple[int, ...], dim: int, axis_name: str
) -> jax.Array:
    """The inverse of :func:`blocks_to_logical`, for a leaf of ``shape``."""
    if logical_dim(shape, jax.lax.axis_size(axis_name)) == dim:
        return block
    return _block_along(logical_gather(block, shape, axis_name), dim, axis_name)


def _from_device(x: jax.Array, device: int, axis_name: str) -> jax.Array:
    """``x`` as ``device`` has it, on every device: a sum of its bits with zeros from
    the others, so every value (``-0.0`` and ``nan`` too) arrives exactly."""
    mine = jax.lax.axis_index(axis_name) == device
    if is_floating(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        summed = jax.lax.psum(jnp.where(mine, bits, 0), axis_name)
        return jax.lax.bitcast_convert_type(summed, x.dtype)
    wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    return jax.lax.psum(jnp.where(mine, wide, 0), axis_name).astype(x.dtype)


def _stored(plan: Plan, rows: tuple[jax.Array, ...], key: Key, device: int, axis_name: str):
    """The value ``device`` stores under ``key``, on every device."""
    r, offset, shape = plan.storage.find(plan.branch_of[device], key)
    value = rows[r][offset : offset + math.prod(shape)]
    return _from_device(value, device, axis_name).reshape(shape)


def _holders(plan: Plan, key: Key) -> tuple[Any, list[int]]:
    """The slot of the layer-owned leaf whose layers ``key``'s value holds (``None``
    where one device holds it whole), and the devices that store it."""
    kind, k = key
    state = None if kind == "master" else plan.state_kinds[k]
    leaf = k if state is None else state.layers_of
    slot = None if leaf is None else plan.layout.slots[leaf]
    if slot is not None and slot.layered:
        return slot, list(dict.fromkeys(slot.owners))
    return None, [plan.layout.slots[k].owner if state is None else state.source]


def _state_to_logical(plan: Plan, rows: tuple, k: int, x: Any, axis_name: str) -> Any:
    """This device's block of the logical value of inner state leaf ``k`` (``x``: what
    the state's tree holds of it; ``rows``: the owners' storage rows)."""
    match plan.state_kinds[k]:
        case SlicedState(leaf):  # (a coded leaf decoded: the logical form is plain optax's)
            return to_logical(plan.layout.slots[leaf], plan.state_kinds[k].decoded(x), axis_name)
        case BlockedState(dim):
            return blocks_to_logical(x, dim, axis_name)
        case OwnedState():
            return _owned_block(plan, rows, ("state", k), axis_name)
    return x  # replicated


def _owned_block(plan: Plan, rows: tuple[jax.Array, ...], key: Key, axis_name: str):
    """This device's block of the logical value stored under ``key`` (an owned leaf's
    state or master): the value from the leaf's owner, or each layer from that
    layer's owner, on every device."""
    slot, devices = _holders(plan, key)
    held = {d: _stored(plan, rows, key, d, axis_name) for d in devices}
    if slot is None:
        return logical_block(held[devices[0]], axis_name)
    layers = {u: held[d][j] for d in devices for j, u in enumerate(slot.units_of(d))}
    return logical_block(jnp.stack([layers[u] for u in range(len(slot.owners))]), axis_name)


def _store_full(plan: Plan, rows, key: Key, full: jax.Array, axis_name: str) -> tuple:
    """``rows`` with the full ``value`` of ``key`` written where its owners store it."""
    slot, devices = _holders(plan, key)
    for d in devices:
        rows = _store(plan, rows, key, d, full if slot is None else slot.local(full, d), axis_name)
    return rows


def _store(plan, rows, key, device, value, axis_name) -> tuple[jax.Array, ...]:
    """``rows`` with ``value`` written where ``device`` stores ``key`` (on that device)."""
    r, offset, shape = plan.storage.find(plan.branch_of[device], key)
    end = offset + math.prod(shape)
    mine = jax.lax.axis_index(axis_name) == device
    row = rows[r]
    new = jnp.where(mine, jnp.ravel(value).astype(row.dtype), row[offset:end])
    return (*rows[:r], row.at[offset:end].set(new), *rows[r + 1 :])


def logical_structs(plan: Plan, tx: ShardedTransformation) -> tuple[PyTree, PyTree]:
    """``ShapeDtypeStruct`` trees of the logical params (master dtype) and inner state."""
    params = plan.layout.full_structs(plan.inner_dtypes)
    return params, jax.eval_shape(tx.inner.init, params)


def _specs(structs: PyTree, num_shards: int, axis_name: str) -> PyTree:
    return jax.tree.map(lambda x: logical_spec(x.shape, num_shards, axis_name), structs)


def describe(tree: PyTree) -> dict[str, dict[str, Any]]:
    """Every leaf of ``tree`` as ``{keystr(path): {"shape": [...], "dtype": name}}``."""
    return {
        jax.tree_util.keystr(path): {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def first_difference(got: dict, want: dict) -> tuple[str, str, str] | None:
    """The first path where two :func:`describe` records differ, with the leaf each
    shows there (``dtype[shape]``, or ``missing``); ``None`` if they agree."""
    show = lambda d: "missing" if d is None else f"{d['dtype']}{d['shape']}"
    for path in dict.fromkeys([*got, *want]):
        if got.get(path) != want.get(path):
            return path, show(got.get(path)), show(want.get(path))
    return None


def _check_tree(tree: PyTree, expected: PyTree, what: str) -> None:
    """Raises a ``ValueError`` if ``tree`` and ``expected`` differ in structure (showing
    both), else naming the first leaf whose shape or dtype differs."""
    structure, want = jax.tree.structure(tree), jax.tree.structure(expected)
    if structure != want:
        raise ValueError(
            f"{what}: tree structure differs ({structure.num_leaves} leaves, expected "
            f"{want.num_leaves}):\n  {structure}\nexpected\n  {want}"
        )
    found = first_difference(describe(tree), describe(expected))
    if found is not None:
        raise ValueError(f"{what}: leaf {found[0]} is {found[1]}, expected {found[2]}.")


def to_optax_state(state: TrainState, tx: ShardedTransformation) -> tuple[PyTree, PyTree]:
    """The logical form of a sharded training state: what plain optax would hold.

    Args:
      state: a :class:`zeroshard.TrainState` on a mesh.
      tx: the optimizer from :func:`zeroshard.sharded` the state belongs to.

    Returns:
      ``(params, opt_state)``: the parameters in the master dtype (the fp32 master
      weights; fp32 parameters are their own master) and ``inner``'s state for them,
      as ``inner.init(params)`` would shape it. Leaves are sharded over the axis along
      their first dimension where it divides by the axis size, else replicated.
    """
    built, mesh = layout_of_state(tx, state), mesh_of(state)
    # (the weights as they are held: the own step's stage-3 pieces, as its state says;
    # the drop-in's stage 3 keeps a weight the devices cannot cut as a padded piece)
    held = jax.tree.leaves(state.params, is_leaf=is_shard)
    pieces = key_of(state.opt_state).pieces or any(map(is_shard, held))
    departure = departure_of(built.tx.config, pieces)
    params = state.params  # (stages 1 and 2 on Explicit axes: laid out whole, or in blocks)
    params = params if departure.pieces else each_laid_out(params, built.layout.leaf_specs(), mesh)
    if departure.pieces:  # (the drop-in's stage 3: its blocks as pieces)
        params = as_pieces(params, built.layout, mesh, built.axis_name)
    # (the drop-in's state beside its weights made pieces: keyed as the converter reads it)
    made = key_of(state.opt_state)
    opt_state = state.opt_state._replace(layout=dataclasses.replace(made, pieces=pieces))
    return _to_optax_converter(built, mesh, departure)(params, opt_state)


@functools.lru_cache(maxsize=64)
def _to_optax_converter(
    built: StateLayout, mesh: jax.sharding.Mesh, departure: Any
) -> Callable[[PyTree, ShardedState], tuple[PyTree, PyTree]]:
    """The jitted conversion of :func:`to_optax_state`, built once per state layout,
    mesh and way of holding the weights (a checkpoint save does not trace it again)."""
    tx, plan, layout = built.tx, built.plan, built.layout
    num_shards, axis = layout.num_shards, tx.axis_name

    def local(params: PyTree, opt_state: ShardedState) -> tuple[PyTree, PyTree]:
        pieces = plan.on_view.ungrouped(
            master_pieces(plan, opt_state, departure.own_pieces(plan, params))
        )

        def block(i: int, s: Slot, x: Any) -> jax.Array:  # of leaf i's master weights
            if not s.owned:
                return to_logical(s, pieces[i], axis)
            if plan.master_dtypes[s.bucket] is not None:  # its owners keep them
                return _owned_block(plan, opt_state.owned, ("master", i), axis)
            if departure.pieces:  # the parameters themselves, a piece on every device
                return to_logical(s, x.piece.reshape(-1), axis)
            return logical_block(x.astype(s.dtype), axis)

        leaves = layout.treedef.flatten_up_to(params)
        master = [block(i, s, x) for i, (s, x) in enumerate(zip(layout.slots, leaves, strict=True))]
        inner = plan.on_state.ungrouped(plan.state_treedef.flatten_up_to(opt_state.inner_state))
        inner = [_state_to_logical(plan, opt_state.owned, k, x, axis) for k, x in enumerate(inner)]
        return layout.treedef.unflatten(master), plan.state_treedef.unflatten(inner)

    specs = built.specs(departure)
    in_specs = (specs.params, specs.opt_state)
    out_specs = _specs(logical_structs(plan, tx), num_shards, axis)
    return on_mesh(local, mesh, axes_of(axis), (in_specs, out_specs))


def from_optax_state(
    params: PyTree,
    opt_state: PyTree,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    param_dtype: Any = None,
    step: int | jax.Array = 0,
    stage: int = 1,
    skipped: int | jax.Array = 0,
    loss_scale: LossScaleState | None = None,
    model_state: PyTree = None,
    param_specs: PyTree = None,
) -> TrainState:
    """A sharded training state from plain optax's: the inverse of :func:`to_optax_state`.

    Args:
      params: full parameters in the master dtype (what a plain optax run trains).
      opt_state: ``tx.inner``'s state for ``params``, as plain optax holds it.
      tx: an optimizer from :func:`zeroshard.sharded`.
      mesh: the mesh to lay the state out on (any device count).
      axis_name: the data-parallel axis; must match ``tx`` (default: ``tx.axis_name``).
      param_dtype: compute dtype of the replicated parameters: one dtype, a tree of
        dtypes like ``params``, or ``None`` to keep ``params``' dtypes.
      step: the step counter to resume from.
      stage: the ZeRO stage to lay the state out for (3: params as pieces).
      skipped: the count of skipped non-finite steps to resume from.
      loss_scale: the dynamic loss scale's state to resume from (default: its initial
        state, when ``tx`` scales the loss).
      model_state: non-trainable model state to carry (replicated), or ``None``.
      param_specs: the weights' layout over ``mesh`` (a ``PartitionSpec`` per leaf, as
        :func:`zeroshard.init_train_state` takes it): over the axes the batch is not
        split over, the state keeps it and the weights take it (default: replicated).

    Returns:
      A :class:`zeroshard.TrainState` laid out exactly as :func:`zeroshard.make_train_step`
      returns it (so continuing does not recompile).

    Raises:
      ValueError: if ``opt_state`` does not have the shape ``tx.inner.init(params)``
        would give, naming the first mismatching leaf.
    """
    check_mesh(optimizer_of(tx).config, mesh, axis_name)
    if param_dtype is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(param_dtype)):
        param_dtype = jax.tree.map(lambda x: param_dtype or x.dtype, params)
    compute_structs = jax.tree.map(
        lambda x, d: jax.ShapeDtypeStruct(x.shape, d), params, param_dtype
    )
    # (the stage decided once, in the config; the weights' layout default: replicated)
    built = state_layout(tx.at_stage(stage), mesh, compute_structs, param_specs)
    departure = departure_of(built.tx.config, kept_apart(built.tx.config.stage)[2])
    tx, plan, num_shards, axis_name = built.tx, built.plan, built.num_shards, built.axis_name
    params_structs, opt_structs = logical_structs(plan, tx)
    _check_tree(params, params_structs, "params")
    _check_tree(opt_state, opt_structs, "optimizer state")
    local = _from_logical_local(tx, plan, departure, jax.tree.leaves(opt_structs))
    in_specs = (*_specs((params_structs, opt_structs), num_shards, axis_name), P(), P(), P(), P())
    out_specs = built.specs(departure)
    if tx.config.loss_scale is not None and loss_scale is None:
        loss_scale = tx.config.loss_scale.init()
    counters = (jnp.asarray(step, jnp.int32), jnp.asarray(skipped, jnp.int32))
    args = (params, opt_state, *counters, loss_scale, model_state)
    state = run_on_mesh(local, mesh, axis_name, (in_specs, out_specs), *args)
    # (pieces: cut so already)
    return state if departure.pieces else laid_out_as(state, built.weight_specs, mesh)


def _from_logical_local(
    tx: ShardedTransformation, plan: Plan, departure: Any, opt_leaves: list
) -> Callable[..., TrainState]:
    """The per-device body of :func:`from_optax_state`: this device's block of every
    logical leaf -> its part of the sharded :class:`zeroshard.TrainState`, the weights
    held as ``departure`` holds them."""
    layout, axis = plan.layout, tx.axis_name

    def local(params, opt_state, step, skipped, scale, model_state) -> TrainState:
        leaves = layout.treedef.flatten_up_to(params)
        pieces = [
            None if s.owned else from_logical(s, x, axis)
            for x, s in zip(leaves, layout.slots, strict=True)
        ]
        master = plan.master_tree(plan.on_view.grouped(pieces))
        fulls = [
            logical_gather(x, s.shape, axis) for x, s in zip(leaves, layout.slots, strict=True)
        ]
        if departure.pieces:
            index = jax.lax.axis_index(axis)
            compute = to_shards(
                layout,
                [
                    s.cut(f, index) if p is None else p.reshape(-1)
                    for p, f, s in zip(pieces, fulls, layout.slots, strict=True)
                ],
            )
        else:  # the weights every device holds after a step: what the departure sends
            index = jax.lax.axis_index(axis)
            rows = layout.per_owned_bucket(
                lambda b, x: layout.owned_blocks(fulls, b, x.dtype)[index]
            )
            cast = layout.sliced(lambda s, p: p.reshape(-1).astype(s.dtype), pieces)
            compute = departure.gather(layout, cast, rows, plan.leaf_order)
        wholes = owned_wholes(plan, layout.treedef.unflatten(fulls))
        inner_state, owned = init_parts(tx.inner, plan, axis, plan.on_view.grouped(pieces), wholes)
        kept = plan.state_treedef.flatten_up_to(inner_state)
        for k, x in enumerate(plan.state_treedef.flatten_up_to(opt_state)):
            shape = opt_leaves[k].shape
            match plan.state_kinds[k]:
                case SlicedState(leaf):
                    kept[k] = plan.state_kinds[k].encoded(from_logical(layout.slots[leaf], x, axis))
                case BlockedState(dim):
                    kept[k] = blocks_from_logical(x, shape, dim, axis)
                case OwnedState():
                    full = logical_gather(x, shape, axis)
                    owned = _store_full(plan, owned, ("state", k), full, axis)
                case _:  # replicated
                    kept[k] = logical_gather(x, shape, axis)
        grad_norm = jnp.zeros((), jnp.float32)
        state = plan.state_treedef.unflatten(plan.on_state.grouped(kept))
        key = LayoutKey.of(tx.config.axes, layout, departure.pieces)
        opt = ShardedState(state, master, grad_norm, skipped, scale, owned, key)
        return TrainState(step, compute, opt, model_state)

    return local
