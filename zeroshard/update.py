"""Update: the one update flow, shared by every entry point.

Inside ``shard_map`` over the sharding axis, one step of the sharded optimizer is:

1. the gradients *arrive* as this device's part of the mean gradient
   (:func:`arrive`): local full gradients are reduce-scattered; in stage 3 the
   gradient of a :class:`zeroshard.Shard` piece arrives reduced already (the
   transpose of its gather), and the pieces of owned leaves go to their owners (one
   ``all_to_all`` per dtype); in the user's own ``jax.jit`` the gradient is the mean
   already and each device cuts its part out (:func:`arrive_mean`);
2. :func:`update` averages that part over the replica axis (if any), casts it to
   the inner dtypes, skips the step everywhere if it is not finite, and runs the
   inner optimizer on this device's part (a 1/N piece of every sliced leaf and the
   whole of each leaf it owns), with the moments and master weights kept here;
3. the parameters *leave*: all-gathered whole (stages 1 and 2), or as
   :class:`zeroshard.Shard` pieces again (stage 3: the owners' new units go back to
   every device's pieces by one ``all_to_all`` per dtype).

``tx.update`` in a user's ``shard_map`` or ``jax.jit``, :func:`zeroshard.make_train_step`
(stages 1-3, with and without accumulation) and the Flax steps all call these functions;
they differ only in how the gradients arrive and how the parameters leave.

Each part runs in a named scope (:mod:`zeroshard.scopes`): ``zeroshard/reduce_scatter``
(or ``zeroshard/cut``, ``zeroshard/to_owners``), ``zeroshard/replica_mean``,
``zeroshard/grad_norm``, ``zeroshard/update``, ``zeroshard/all_gather`` (or
``zeroshard/from_owners``), so a profile and the compiled program's op names tell them
apart.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from zeroshard.branches import (
    kept_and_stored,
    owned_wholes,
    replicated_again,
    run_branches,
    stored_state,
    varying,
    varying_like,
)
from zeroshard.clipping import local_squares
from zeroshard.collectives import (
    all_gather_params,
    is_identity,
    reduce_scatter_leaves,
    reduce_scatter_owned,
)
from zeroshard.layout import Layout, PyTree
from zeroshard.placement import Plan
from zeroshard.scopes import (
    ALL_GATHER,
    CUT,
    FROM_OWNERS,
    GRAD_NORM,
    REDUCE_SCATTER,
    REPLICA_MEAN,
    TO_OWNERS,
    UPDATE,
    scope,
)
from zeroshard.stage3 import (
    exchange,
    full_structs,
    is_shard,
    owner_blocks,
    piece_blocks,
    piece_from_owners,
    to_owners,
    to_shards,
    units_from_pieces,
)

if TYPE_CHECKING:
    from zeroshard.sharded import Sharded, ShardedState

GradParts = tuple[list[jax.Array | None], tuple[jax.Array | None, ...]]
"""This device's part of the mean gradient: a 1-D piece per sliced leaf (``None`` for
owned leaves), and per bucket its row of owned leaves (``None`` if it has none)."""


def arrive(opt: Sharded, plan: Plan, grads: PyTree) -> GradParts:
    """This device's part of the mean gradient over the sharding axis (the replica
    axis, if any, is averaged in :func:`update`, once per step).

    Full local gradients are reduce-scattered leaf by leaf (small leaves packed). The
    gradient of a stage-3 :class:`zeroshard.Shard` arrives as a piece summed over the
    devices (the transpose of its gather) and is divided by their number; the pieces
    of owned leaves then go to their owners (:func:`arrive_pieces`).
    """
    layout, config = plan.layout, opt.config
    layout.check_matches(full_structs(grads), "gradients")
    axis, dtype = config.axis_name, config.reduce_dtype
    leaves = layout.treedef.flatten_up_to(grads)
    if any(is_shard(g) for g in leaves):
        with scope(REDUCE_SCATTER):  # the mean of the pieces the gather's transpose summed
            pieces = [g.piece.reshape(-1) / layout.num_shards for g in leaves]
        return arrive_pieces(opt, plan, pieces)
    check_local(leaves, layout, axis)
    with scope(REDUCE_SCATTER):
        pieces = reduce_scatter_leaves(grads, layout, axis, dtype, config.pack_bytes)
        return pieces, reduce_scatter_owned(grads, layout, axis, dtype)


def arrive_pieces(opt: Sharded, plan: Plan, pieces: list[jax.Array]) -> GradParts:
    """Stage 3: this device's 1-D piece of every leaf's mean gradient -> its part: the
    sliced leaves' pieces, and what every device holds of the units it owns (one
    ``all_to_all`` per bucket with owned leaves)."""
    config, layout = opt.config, plan.layout
    with scope(TO_OWNERS):
        owned = to_owners(pieces, layout, config.axis_name, config.reduce_dtype)
    return [None if s.owned else p for p, s in zip(pieces, layout.slots, strict=True)], owned


def check_local(leaves: list, layout: Layout, axis_name: str) -> None:
    """Refuses gradients typed invariant over ``axis_name`` where types are checked
    (``shard_map``'s default ``check_vma=True``): such a gradient was all-reduced
    already (the gradient of a replicated input is), so reduce-scattering it again
    would make it ``num_shards`` times too large, silently.

    Raises:
      ValueError: naming the first such leaf and the fix (``jax.lax.pcast``).
    """
    if jax.lax.axis_size(axis_name) == 1:
        return
    index = jax.lax.axis_index(axis_name)
    if axis_name not in jax.typeof(index).manual_axis_type.varying:
        return  # check_vma=False: no types to read
    for g, s in zip(leaves, layout.slots, strict=True):
        if axis_name not in jax.typeof(g).manual_axis_type.varying:
            raise ValueError(
                f"zs.sharded(...).update got a gradient for {s.path} that is the same on "
                f"every device of {axis_name!r} (typed invariant): it was reduced already, "
                "since inside jax.shard_map the gradient of a replicated input is summed over "
                "the devices. Reduce-scattering it again would make it "
                f"{layout.num_shards} times too large. Differentiate with respect to "
                f"jax.lax.pcast(params, {axis_name!r}, to='varying') to get each device's "
                "local gradient; or call tx.update outside shard_map, in a jax.jit, with the "
                "mean gradient."
            )


def arrive_mean(opt: Sharded, plan: Plan, grads: PyTree) -> GradParts:
    """This device's part of ``grads``, the mean gradient itself (invariant over the
    axis: reduced already, as ``jax.grad`` in a ``jax.jit`` over a sharded batch
    reduces it): each device cuts its pieces, and its owned row, out of it."""
    layout, config = plan.layout, opt.config
    layout.check_matches(grads, "gradients")
    index = jax.lax.axis_index(config.axis_name)
    cast = lambda x: x.astype(config.reduce_dtype or x.dtype)
    with scope(CUT):
        leaves = [cast(g) for g in layout.treedef.flatten_up_to(grads)]
        pieces = [
            None if s.owned else s.cut(g, index) for g, s in zip(leaves, layout.slots, strict=True)
        ]
        rows = tuple(
            layout.owned_blocks(leaves, b, config.reduce_dtype or bucket.dtype)[index]
            if bucket.owned_width
            else None
            for b, bucket in enumerate(layout.buckets)
        )
    return pieces, rows


def update(
    opt: Sharded,
    plan: Plan,
    parts: GradParts,
    state: ShardedState,
    params: PyTree,
    averaged: bool = False,
    **extra_args: Any,
) -> tuple[PyTree, ShardedState]:
    """The sharded update of this device's part: returns the new parameters, laid out
    as ``params`` (whole, or stage-3 :class:`zeroshard.Shard` pieces), and state.

    Args:
      opt: the sharded optimizer.
      plan: its plan for the parameters.
      parts: this device's part of the mean gradient over the sharding axis
        (:func:`arrive`).
      state: this device's :class:`zeroshard.ShardedState`.
      params: the current parameters: whole and replicated, or stage-3 pieces.
      averaged: whether ``parts`` are averaged over every batch axis already
        (:func:`arrive_mean`); else they are averaged over the replica axis here.
      **extra_args: passed on to the inner ``update``.
    """
    config, layout = opt.config, plan.layout
    if config.replica_axis is not None and not averaged:
        with scope(REPLICA_MEAN):
            parts = jax.lax.pmean(parts, config.replica_axis)
    wholes = owned_params(plan, params, config.axis_name)
    with scope(UPDATE):
        parts = to_inner(plan, parts)
        pieces = master_pieces(plan, state, own_pieces(plan, params, config.axis_name))
    new, rows, state = update_parts(opt, plan, parts, state, pieces, wholes, **extra_args)
    leaves = layout.treedef.flatten_up_to(params)
    if any(is_shard(x) for x in leaves):
        with scope(FROM_OWNERS):
            back = exchange(rows, config.axis_name)  # the owners' units -> pieces
            new = [
                _new_piece(plan, i, piece_from_owners(layout, back[s.bucket], i), x)
                if s.owned
                else p
                for i, (p, s, x) in enumerate(zip(new, layout.slots, leaves, strict=True))
            ]
            return to_shards(layout, new), state
    with scope(ALL_GATHER):
        return all_gather_params(new, layout, config.axis_name, config.pack_bytes, rows), state


def _unread(plan: Plan, i: int) -> bool:
    """Whether owned leaf ``i``'s stage-3 weights stay with their pieces: no master holds
    them and the update does not read them, so its owners get zeros for them, and
    what they send back is the update (zeros plus the update), which each device adds
    to its piece: the same sum as the owner's would be."""
    return plan.master_dtypes[plan.layout.slots[i].bucket] is None and i not in plan.analysis.reads


def _new_piece(plan: Plan, i: int, received: jax.Array, old: Any) -> jax.Array:
    """This device's new stage-3 piece of owned leaf ``i`` from what its owners sent."""
    if not _unread(plan, i):
        return received
    return old.piece.reshape(-1) + received.astype(old.dtype)


def owned_params(plan: Plan, params: PyTree, axis_name: str) -> Any:
    """The current weights of the owned leaves, as the update reads them where it keeps
    no master for them: the full leaves (a list, ``None`` for sliced ones); in stage 3,
    per bucket what each device holds of this device's units (a tuple of
    ``(num_shards, owned_chunk)`` blocks), gathered only where a bucket keeps no master
    and the update reads them (Muon without weight decay does not)."""
    leaves = plan.layout.treedef.flatten_up_to(params)
    if not any(is_shard(x) for x in leaves):
        with scope(UPDATE):
            return owned_wholes(plan, params)
    layout, dtypes = plan.layout, plan.inner_dtypes
    read = {  # buckets with owned leaves whose update reads weights no master holds
        s.bucket
        for i, s in enumerate(layout.slots)
        if s.owned and plan.master_dtypes[s.bucket] is None and not _unread(plan, i)
    }
    with scope(TO_OWNERS):
        pieces = [
            x.piece.reshape(-1).astype(dtypes[s.bucket]) if s.bucket in read else None
            for x, s in zip(leaves, layout.slots, strict=True)
        ]
        blocks = [
            owner_blocks(layout, pieces, b, dtypes[b]) if b in read else None
            for b in range(len(layout.buckets))
        ]
        return exchange(blocks, axis_name)


def to_inner(plan: Plan, parts: GradParts) -> GradParts:
    """``parts`` in the dtypes the inner optimizer works in."""
    pieces, rows = parts
    dtypes = plan.inner_dtypes
    return plan.to_inner(pieces), tuple(
        None if r is None else r.astype(d) for r, d in zip(rows, dtypes, strict=True)
    )


def own_pieces(plan: Plan, params: PyTree, axis_name: str) -> list[jax.Array | None]:
    """This device's 1-D piece of every sliced leaf of ``params`` (whole leaves are cut,
    stage-3 pieces taken as they are); ``None`` for owned leaves."""
    index = jax.lax.axis_index(axis_name)
    return [
        None if s.owned else x.piece.reshape(-1) if is_shard(x) else s.cut(x, index)
        for x, s in zip(plan.layout.treedef.flatten_up_to(params), plan.layout.slots, strict=True)
    ]


def master_pieces(
    plan: Plan, state: ShardedState, own: list[jax.Array | None]
) -> list[jax.Array | None]:
    """This device's pieces of the sliced leaves' master weights (1-D, inner dtypes;
    ``None`` for owned leaves).

    Args:
      plan: the plan for the parameters.
      state: this device's :class:`zeroshard.ShardedState`.
      own: this device's pieces of the parameters themselves (used where no separate
        master is kept).
    """
    layout = plan.layout
    master = (
        [None] * len(own) if state.master is None else layout.treedef.flatten_up_to(state.master)
    )
    return [
        None if s.owned else p.astype(plan.inner_dtypes[s.bucket]) if m is None else m.reshape(-1)
        for p, m, s in zip(own, master, layout.slots, strict=True)
    ]


def update_parts(
    opt: Sharded,
    plan: Plan,
    grads: GradParts,
    state: ShardedState,
    pieces: list[jax.Array | None],
    wholes: list[jax.Array | None],
    **extra_args: Any,
) -> tuple[list[jax.Array | None], tuple[jax.Array | None, ...], ShardedState]:
    """The inner update on this device's part: returns the new pieces of the sliced
    leaves, the new owned row per bucket (as :data:`GradParts`) and the new state.

    Args:
      opt: the sharded optimizer.
      plan: its plan for the parameters.
      grads: this device's part of the mean gradient, in the inner dtypes.
      state: this device's :class:`zeroshard.ShardedState`.
      pieces: this device's pieces of the sliced leaves' master weights (see
        :func:`master_pieces`).
      wholes: the owned leaves' full parameters (see
        :func:`zeroshard.branches.owned_wholes`), used where no separate master is kept.
      **extra_args: passed on to the inner ``update``.
    """
    config = opt.config
    grad_pieces, grad_rows = grads
    if config.loss_scale is not None:  # the gradients are of the scaled loss
        unscale = lambda g: None if g is None else (g / state.loss_scale.scale).astype(g.dtype)
        with scope(UPDATE):
            grad_pieces = list(map(unscale, grad_pieces))
            grad_rows = tuple(map(unscale, grad_rows))
    present = [g for g in (*grad_pieces, *grad_rows) if g is not None]
    with scope(GRAD_NORM):
        grad_norm, finite = norm_and_finite(present, config.axis_name)
    with scope(UPDATE):
        update_branch = _branch_update(opt, plan, extra_args)
        args = (grad_pieces, grad_rows, pieces, wholes, state, finite)
        new, rows, inner_state, owned = run_branches(plan, config.axis_name, update_branch, *args)
        inner_state = replicated_again(plan, config.axis_name, inner_state)
        skipped = state.skipped
        if config.skip_nonfinite:
            skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
        master = None if state.master is None else plan.master_tree(new)
        scale = None
        if config.loss_scale is not None:
            scale = config.loss_scale.adjust(state.loss_scale, finite)
    new_state = state._replace(
        inner_state=inner_state,
        master=master,
        grad_norm=grad_norm,
        skipped=skipped,
        loss_scale=scale,
        owned=owned,
    )
    return new, rows, new_state


def _branch_update(opt: Sharded, plan: Plan, extra_args: dict) -> Any:
    """The update of one branch (see :mod:`zeroshard.branches`): its view of the
    gradients and weights, the inner update (in a conditional on ``finite`` when
    non-finite steps are skipped), and its new pieces, owned rows and state."""
    axis, layout = opt.config.axis_name, plan.layout

    def update_branch(b, grad_pieces, grad_rows, pieces, wholes, state, finite):
        stored, device = plan.storage.unpack(state.owned, b), plan.branch_of.index(b)
        owned = dict(plan.branches[b])
        g = [
            owned_local(layout, grad_rows[s.bucket], i, device) if i in owned else None
            for i, s in enumerate(layout.slots)
        ]
        if isinstance(wholes, tuple):  # stage 3: what each device holds of the units
            local = [
                owned_local(layout, wholes[s.bucket], i, device)
                if i in owned and wholes[s.bucket] is not None and not _unread(plan, i)
                else None
                for i, s in enumerate(layout.slots)
            ]
        else:
            local = plan.local_wholes(b, wholes, axis)
        zeros = lambda i: jnp.zeros_like(g[i], plan.inner_dtypes[layout.slots[i].bucket])
        p = [  # weights the update does not read, in stage 3: zeros (see _unread)
            stored.get(("master", i), zeros(i) if local[i] is None else local[i])
            if i in owned
            else None
            for i in range(len(g))
        ]
        inner_state = stored_state(plan, b, state.inner_state, stored)
        # The new weights vary over the axis: so must the old ones (whole leaves come
        # from the replicated params) for the conditional below.
        params = varying(plan.view(b, pieces, p, axis), axis)
        grads = plan.view(b, grad_pieces, g, axis)

        def step(inner_state, params):
            updates, new_state = plan.update(
                opt.inner, grads, inner_state, params, axis, **extra_args
            )
            new = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
            return new, varying_like(new_state, inner_state, axis)

        if opt.config.skip_nonfinite:
            # One conditional, not a select per element: the update runs in place, with
            # no copy of the old state kept alive until the verdict.
            new, new_state = jax.lax.cond(finite, step, _unchanged, inner_state, params)
        else:
            new, new_state = step(inner_state, params)
        new = layout.treedef.flatten_up_to(new)
        stage3 = any(r is not None and r.ndim == 2 for r in grad_rows)
        out = functools.partial(piece_blocks, layout) if stage3 else layout.owned_row
        rows = tuple(
            out(new, device, k, dtype) if bucket.owned_width else None
            for k, (bucket, dtype) in enumerate(zip(layout.buckets, plan.inner_dtypes, strict=True))
        )
        kept, owned_rows = kept_and_stored(plan, b, new_state, new)
        new_pieces = [
            None if s.owned else jnp.ravel(x) for x, s in zip(new, layout.slots, strict=True)
        ]
        return new_pieces, rows, kept, owned_rows

    return update_branch


def owned_local(layout: Layout, x: jax.Array, i: int, device: int) -> jax.Array:
    """``device``'s units of owned leaf ``i`` from its owned row (stages 1 and 2), or
    from what every device holds of its units (stage 3: ``(num_shards, owned_chunk)``)."""
    return (
        layout.owned_local(x, i, device) if x.ndim == 1 else units_from_pieces(layout, x, i, device)
    )


def _unchanged(inner_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
    return params, inner_state


def norm_and_finite(pieces: list[jax.Array], axis_name: str) -> tuple[jax.Array, jax.Array]:
    """The global L2 norm of the pieces and whether every element on every device is
    finite: one scalar all-reduce, so every device takes the same decision."""
    squares = local_squares(pieces)
    bad = sum((jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in pieces), jnp.int32(0))
    if not is_identity((squares, bad), axis_name):
        squares, bad = jax.lax.psum((squares, bad), axis_name)
    return jnp.sqrt(squares), bad == 0
