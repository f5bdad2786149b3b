"""Local update: the optax wrapper that runs an inner optimizer on this device's part.

``sharded(inner)`` chains the data flow of one step: reduce-scatter of the local
gradients, ``inner.update`` on this device's part of the parameters (a 1/N slice of
every sliced leaf and the whole of each leaf it owns; see :mod:`zeroshard.plan`), with
the moments and fp32 master kept here, and all-gather of the new weights in the
parameters' dtype.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeroshard.all_gather import all_gather_params
from zeroshard.clipping import local_squares
from zeroshard.layout import Layout, PyTree, Stacked
from zeroshard.loss_scale import DynamicLossScale, LossScaleState
from zeroshard.plan import Plan, make_plan
from zeroshard.reduce_scatter import is_identity, reduce_scatter_leaves, reduce_scatter_owned

Placement = Any
"""Forced placements: a tree like the parameters, or a function ``(path, leaf) -> str``,
giving ``"sliced"``, ``"owned"`` or ``None`` (automatic) per leaf."""

GradParts = tuple[list[jax.Array | None], tuple[jax.Array | None, ...]]
"""This device's part of the mean gradient: a 1-D piece per sliced leaf (``None`` for
owned leaves), and per bucket its row of owned leaves (``None`` if it has none)."""


class ShardedState(NamedTuple):
    """State of :func:`sharded`; every array is this device's part or a scalar.

    Attributes:
      inner_state: the inner optimizer's state for this device's pieces, with
        ``None`` in place of each leaf that belongs to owned leaves (kept in ``owned``).
      master: per dtype bucket, this device's row of master weights of its sliced
        leaves, or ``None`` where the parameters are already in the master dtype
        (their slice is the master).
      grad_norm: global L2 norm of the mean gradient at the last update, before any
        clipping (``nan`` or ``inf`` when that gradient was not finite).
      skipped: number of updates skipped because the mean gradient was not finite
        (int32; see ``skip_nonfinite`` in :func:`sharded`).
      loss_scale: the dynamic loss scale's state, or ``None`` without loss scaling.
      owned: per dtype, this device's row of the inner state and master weights of
        the leaves it owns (see :class:`zeroshard.plan.Storage`); ``()`` when no leaf
        is owned.
    """

    inner_state: optax.OptState
    master: tuple[jax.Array | None, ...]
    grad_norm: jax.Array
    skipped: jax.Array
    loss_scale: LossScaleState | None = None
    owned: tuple[jax.Array, ...] = ()


class ShardedTransformation(optax.GradientTransformationExtraArgs):
    """The transformation :func:`sharded` returns: an optax one that also knows its axis.

    Attributes (besides ``init`` and ``update``): ``inner``, ``axis_name``,
    ``replica_axis``, ``master_dtype``, ``reduce_dtype``, ``skip_nonfinite``,
    ``pack_bytes``, ``loss_scale``, ``stacked`` and ``placement`` as given to
    :func:`sharded`.
    """

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: the replica axis (if any), then the
        sharding axis."""
        return (
            (self.axis_name,) if self.replica_axis is None else (self.replica_axis, self.axis_name)
        )

    def plan(self, params: PyTree, num_shards: int) -> Plan:
        """The (cached) :class:`zeroshard.plan.Plan` for ``params`` over ``num_shards``
        devices."""
        layout = Layout.from_tree(params, num_shards, self.stacked)
        if layout not in self._plans:
            plan = self._plans[layout] = make_plan(self, layout)
            _log_owned(plan)
        return self._plans[layout]

    def state_specs(self, params: PyTree, num_shards: int) -> ShardedState:
        """``PartitionSpec`` of every leaf of the global state, for ``jax.shard_map``."""
        plan = self.plan(params, num_shards)
        views = jax.eval_shape(self.inner.init, plan.view_structs(0))
        specs = [
            None
            if plan.state_kind(k) == "owned"
            else P()
            if plan.state_kind(k) == "replicated"
            else P(*(None,) * (leaf.ndim - 1), self.axis_name)
            for k, leaf in enumerate(plan.state_treedef.flatten_up_to(views))
        ]
        master = tuple(None if m is None else P(self.axis_name) for m in plan.master_dtypes)
        scale = None if self.loss_scale is None else LossScaleState(P(), P())
        owned = tuple(P(self.axis_name) for _ in plan.storage.dtypes)
        return ShardedState(plan.state_treedef.unflatten(specs), master, P(), P(), scale, owned)


def _log_owned(plan: Plan) -> None:
    """One line at init when leaves are owned: how many, and the load per device."""
    owned = [s for s in plan.layout.slots if s.owned]
    if not owned:
        return
    nbytes, costs = plan.owned_bytes(), plan.owned_costs()
    mean = sum(costs) / len(costs)
    logging.getLogger("zeroshard").info(
        "zeroshard: %d of %d leaves owned whole (their update needs the whole tensor) over "
        "%d devices: owned state %s..%s bytes per device, update cost max/mean %.2f",
        len(owned),
        len(plan.layout.slots),
        plan.layout.num_shards,
        f"{min(nbytes):,}",
        f"{max(nbytes):,}",
        max(costs) / mean if mean else 1.0,
    )


def run_branches(plan: Plan, axis_name: str, fn: Any, *args: Any) -> Any:
    """``fn(branch, *args)`` for this device's branch: a ``lax.switch`` on the device's
    index over the branches (each device runs only its own), or a plain call when
    every device has the same view."""
    if len(plan.branches) == 1:
        return fn(0, *args)
    index = jnp.asarray(plan.branch_of, jnp.int32)[jax.lax.axis_index(axis_name)]

    def branch(b, *args):  # every output varies over the axis, as the switch's do
        return varying(fn(b, *args), axis_name)

    branches = [functools.partial(branch, b) for b in range(len(plan.branches))]
    return jax.lax.switch(index, branches, *args)


def varying(tree: PyTree, axis_name: str) -> PyTree:
    """``tree`` typed as varying over ``axis_name`` (a cast; no data moves)."""
    vary = lambda x: (
        x
        if axis_name in jax.typeof(x).manual_axis_type.varying
        else jax.lax.pcast(x, axis_name, to="varying")
    )
    return jax.tree.map(vary, tree)


def replicated_again(plan: Plan, axis_name: str, inner_state: PyTree) -> PyTree:
    """The replicated leaves of ``inner_state`` after :func:`run_branches`, typed
    invariant over ``axis_name`` again: equal everywhere, device 0's are taken, with
    one small all-gather per dtype."""
    if len(plan.branches) == 1:
        return inner_state
    leaves = plan.state_treedef.flatten_up_to(inner_state)
    replicated = [k for k in range(len(leaves)) if plan.state_kind(k) == "replicated"]
    keys = {k: jax.random.key_impl(leaves[k]) for k in replicated if _is_key(leaves[k])}
    flat = {k: jax.random.key_data(leaves[k]) if k in keys else leaves[k] for k in replicated}
    for dtype in dict.fromkeys(x.dtype for x in flat.values()):  # the same order everywhere
        group = [k for k in replicated if flat[k].dtype == dtype]
        row = jnp.concatenate([jnp.ravel(flat[k]) for k in group])
        row = jax.lax.all_gather(row, axis_name, to="invarying")[0]
        start = 0
        for k in group:
            x = row[start : start + flat[k].size].reshape(flat[k].shape)
            leaves[k] = jax.random.wrap_key_data(x, impl=keys[k]) if k in keys else x
            start += flat[k].size
    return plan.state_treedef.unflatten(leaves)


def _is_key(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _kept_and_stored(plan: Plan, branch: int, state: PyTree, wholes: dict) -> tuple:
    """Inner ``state`` of ``branch`` split into the tree it keeps (``None`` at owned
    leaves) and its storage rows (owned state, plus ``wholes``: owned master weights)."""
    leaves = plan.state_treedef.flatten_up_to(state)
    values = {("state", k): x for k, x in enumerate(leaves) if plan.state_kind(k) == "owned"}
    values.update(wholes)
    kept = [None if plan.state_kind(k) == "owned" else x for k, x in enumerate(leaves)]
    return plan.state_treedef.unflatten(kept), plan.storage.pack(values, branch)


def _masters(plan: Plan, branch: int, wholes: list) -> dict:
    """The owned master weights ``branch`` stores, from its whole leaves."""
    return {
        ("master", i): wholes[i]
        for i in plan.branches[branch]
        if plan.master_dtypes[plan.layout.slots[i].bucket] is not None
    }


def init_local(
    tx: ShardedTransformation, params: PyTree, master_params: PyTree | None = None
) -> ShardedState:
    """This device's state, inside ``shard_map`` over ``tx.axis_name``.

    Args:
      tx: the sharded transformation.
      params: the full parameters in their compute dtype.
      master_params: optional full-precision values to start the master weights from
        (default: ``params``).
    """
    plan = tx.plan(params, jax.lax.axis_size(tx.axis_name))
    source = params if master_params is None else master_params
    plan.layout.check_matches(source, "master_params")
    pieces = plan.to_inner(plan.layout.pieces(source, jax.lax.axis_index(tx.axis_name)))
    wholes = owned_wholes(plan, source)
    rows = plan.layout.rows(pieces)
    master = tuple(
        None if m is None else row for m, row in zip(plan.master_dtypes, rows, strict=True)
    )

    inner_state, owned = init_parts(tx, plan, pieces, wholes)
    scale = None if tx.loss_scale is None else tx.loss_scale.init()
    zero = jnp.zeros((), jnp.float32)
    return ShardedState(inner_state, master, zero, jnp.zeros((), jnp.int32), scale, owned)


def init_parts(
    tx: ShardedTransformation,
    plan: Plan,
    pieces: list[jax.Array | None],
    wholes: list[jax.Array | None],
) -> tuple[PyTree, tuple[jax.Array, ...]]:
    """This device's initial inner state (``None`` at owned leaves) and owned rows, from
    its master pieces of the sliced leaves and the owned leaves' full master weights."""

    def init_branch(b, pieces, wholes):
        state = tx.inner.init(plan.view(b, pieces, wholes, tx.axis_name))
        return _kept_and_stored(plan, b, state, _masters(plan, b, wholes))

    inner_state, owned = run_branches(plan, tx.axis_name, init_branch, pieces, wholes)
    return replicated_again(plan, tx.axis_name, inner_state), owned


def owned_wholes(plan: Plan, params: PyTree) -> list[jax.Array | None]:
    """The full leaves of ``params`` that are owned, in the inner dtypes (``None`` for
    sliced leaves)."""
    leaves = plan.layout.treedef.flatten_up_to(params)
    dtypes = plan.inner_dtypes
    return [
        x.astype(dtypes[s.bucket]) if s.owned else None
        for x, s in zip(leaves, plan.layout.slots, strict=True)
    ]


def init_global(
    tx: ShardedTransformation,
    params: PyTree,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    master_params: PyTree | None = None,
) -> ShardedState:
    """The global state (arrays sharded over ``tx.axis_name`` of ``mesh``).

    ``params`` (and ``master_params``) must be replicated or not yet placed.
    """
    specs = tx.state_specs(params, mesh.shape[tx.axis_name])
    init = jax.shard_map(
        lambda p, m: init_local(tx, p, m),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=specs,
        axis_names={tx.axis_name},
    )
    return jax.jit(init)(params, master_params)


def checked_plan(tx: ShardedTransformation, state: ShardedState, params: PyTree) -> Plan:
    """The plan for ``params`` inside ``shard_map``, after checking the arguments."""
    if params is None:
        raise ValueError(
            "zs.sharded(...).update needs `params` (the current full parameters): "
            "call tx.update(grads, opt_state, params)."
        )
    if not isinstance(state, ShardedState):
        raise TypeError(
            f"zs.sharded(...).update got a {type(state).__name__} state; pass the state "
            "returned by the same transformation's init."
        )
    num_shards = bound_axis_size(tx.axis_name)
    if num_shards is None:
        raise ValueError(
            f"zs.sharded(...).update must run inside jax.shard_map over {tx.axis_name!r}: it "
            "reduce-scatters each device's local gradients (jax.set_mesh is not enough). Use "
            "a ready step: zs.make_train_step(loss_fn, tx, mesh); with Linen, "
            "zeroshard.flax.linen_train_step(loss_fn, tx, mesh) instead of calling "
            "state.apply_gradients yourself; with NNX, zeroshard.flax.nnx_train_step(loss_fn, "
            "mesh) instead of optimizer.update in nnx.jit."
        )
    plan = tx.plan(params, num_shards)
    if len(state.master) != len(plan.layout.buckets) or len(state.owned) != len(
        plan.storage.dtypes
    ):
        raise ValueError(
            "zs.sharded: the optimizer state was made for other parameters "
            f"({len(state.master)} dtype buckets, these params have "
            f"{len(plan.layout.buckets)})."
        )
    return plan


def reduce_scatter_parts(tx: ShardedTransformation, plan: Plan, grads: PyTree) -> GradParts:
    """This device's part of the mean gradient (see :data:`GradParts`), averaged over
    ``tx.axis_name`` only (the replica axis is averaged by :func:`mean_over_replicas`)."""
    plan.layout.check_matches(grads, "gradients")
    layout, axis = plan.layout, tx.axis_name
    pieces = reduce_scatter_leaves(grads, layout, axis, tx.reduce_dtype, tx.pack_bytes)
    return pieces, reduce_scatter_owned(grads, layout, axis, tx.reduce_dtype)


def mean_over_replicas(tx: ShardedTransformation, parts: GradParts) -> GradParts:
    """``parts`` averaged over ``tx.replica_axis`` (unchanged without one)."""
    if tx.replica_axis is None:
        return parts
    return jax.lax.pmean(parts, tx.replica_axis)


def to_inner(plan: Plan, parts: GradParts) -> GradParts:
    """``parts`` in the dtypes the inner optimizer works in."""
    pieces, rows = parts
    dtypes = plan.inner_dtypes
    return plan.to_inner(pieces), tuple(
        None if r is None else r.astype(d) for r, d in zip(rows, dtypes, strict=True)
    )


def master_pieces(
    plan: Plan, state: ShardedState, own: list[jax.Array | None]
) -> list[jax.Array | None]:
    """This device's pieces of the sliced leaves' master weights (1-D, inner dtypes;
    ``None`` for owned leaves).

    Args:
      plan: the plan for the parameters.
      state: this device's :class:`ShardedState`.
      own: this device's pieces of the parameters themselves (used where no separate
        master is kept).
    """
    return [
        None
        if s.owned
        else p.astype(plan.inner_dtypes[s.bucket])
        if state.master[s.bucket] is None
        else state.master[s.bucket][s.offset : s.offset + s.piece_size]
        for p, s in zip(own, plan.layout.slots, strict=True)
    ]


def update_parts(
    tx: ShardedTransformation,
    plan: Plan,
    grads: GradParts,
    state: ShardedState,
    pieces: list[jax.Array | None],
    wholes: list[jax.Array | None],
    **extra_args,
) -> tuple[list[jax.Array | None], tuple[jax.Array | None, ...], ShardedState]:
    """The inner update on this device's part: returns the new pieces of the sliced
    leaves, the new owned row per bucket (as :data:`GradParts`) and the new state.

    Args:
      tx: the sharded transformation.
      plan: its plan for the parameters.
      grads: this device's part of the mean gradient, in the inner dtypes.
      state: this device's :class:`ShardedState`.
      pieces: this device's pieces of the sliced leaves' master weights (see
        :func:`master_pieces`).
      wholes: the owned leaves' full parameters (see :func:`owned_wholes`), used
        where no separate master is kept.
      **extra_args: passed on to the inner ``update``.
    """
    grad_pieces, grad_rows = grads
    if tx.loss_scale is not None:  # the gradients are of the scaled loss
        unscale = lambda g: None if g is None else (g / state.loss_scale.scale).astype(g.dtype)
        grad_pieces, grad_rows = list(map(unscale, grad_pieces)), tuple(map(unscale, grad_rows))
    present = [g for g in (*grad_pieces, *grad_rows) if g is not None]
    grad_norm, finite = _norm_and_finite(present, tx.axis_name)

    def update_branch(b, grad_pieces, grad_rows, pieces, wholes, state, finite):
        layout, stored = plan.layout, plan.storage.unpack(state.owned, b)
        owned = plan.branches[b]
        g = [
            layout.owned_leaf(grad_rows[layout.slots[i].bucket], i) if i in owned else None
            for i in range(len(layout.slots))
        ]
        p = [
            stored.get(("master", i), wholes[i]) if i in owned else None
            for i in range(len(layout.slots))
        ]
        leaves = plan.state_treedef.flatten_up_to(state.inner_state)
        inner_state = plan.state_treedef.unflatten(
            stored[("state", k)] if plan.state_kind(k) == "owned" else x
            for k, x in enumerate(leaves)
        )
        # The new weights vary over the axis: so must the old ones (whole leaves come
        # from the replicated params) for the conditional below.
        params = varying(plan.view(b, pieces, p, tx.axis_name), tx.axis_name)
        grads = plan.view(b, grad_pieces, g, tx.axis_name)

        def step(inner_state, params):
            updates, new_state = plan.update(
                tx.inner, grads, inner_state, params, tx.axis_name, **extra_args
            )
            return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates), new_state

        if tx.skip_nonfinite:
            # One conditional, not a select per element: the update runs in place, with
            # no copy of the old state kept alive until the verdict.
            new, new_state = jax.lax.cond(finite, step, _unchanged, inner_state, params)
        else:
            new, new_state = step(inner_state, params)
        new = layout.treedef.flatten_up_to(new)
        device = plan.branch_of.index(b)
        rows = tuple(
            layout.owned_row(new, device, k, dtype) if bucket.owned_width else None
            for k, (bucket, dtype) in enumerate(zip(layout.buckets, plan.inner_dtypes, strict=True))
        )
        kept, owned_rows = _kept_and_stored(plan, b, new_state, _masters(plan, b, new))
        new_pieces = [
            None if s.owned else jnp.ravel(x) for x, s in zip(new, layout.slots, strict=True)
        ]
        return new_pieces, rows, kept, owned_rows

    new, rows, inner_state, owned = run_branches(
        plan, tx.axis_name, update_branch, grad_pieces, grad_rows, pieces, wholes, state, finite
    )
    inner_state = replicated_again(plan, tx.axis_name, inner_state)
    skipped = state.skipped
    if tx.skip_nonfinite:
        skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
    master_rows = plan.layout.rows(new) if any(m is not None for m in state.master) else None
    master = tuple(None if m is None else master_rows[b] for b, m in enumerate(state.master))
    scale = None if tx.loss_scale is None else tx.loss_scale.adjust(state.loss_scale, finite)
    return new, rows, ShardedState(inner_state, master, grad_norm, skipped, scale, owned)


def _unchanged(inner_state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
    return params, inner_state


def _norm_and_finite(pieces: list[jax.Array], axis_name: str) -> tuple[jax.Array, jax.Array]:
    """The global L2 norm of the pieces and whether every element on every device is
    finite: one scalar all-reduce, so every device takes the same decision."""
    squares = local_squares(pieces)
    bad = sum((jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in pieces), jnp.int32(0))
    if not is_identity((squares, bad), axis_name):
        squares, bad = jax.lax.psum((squares, bad), axis_name)
    return jnp.sqrt(squares), bad == 0


def apply_update(
    tx: ShardedTransformation, grads: PyTree, state: ShardedState, params: PyTree, **extra_args
) -> tuple[PyTree, ShardedState]:
    """One sharded step inside ``shard_map``: returns the new full params and state.

    Args:
      tx: the sharded transformation.
      grads: this device's local, unreduced gradients.
      state: this device's :class:`ShardedState`.
      params: the current full parameters (replicated).
      **extra_args: passed on to the inner ``update``.
    """
    plan = checked_plan(tx, state, params)
    parts = to_inner(plan, mean_over_replicas(tx, reduce_scatter_parts(tx, plan, grads)))
    own = plan.layout.pieces(params, jax.lax.axis_index(tx.axis_name))
    pieces = master_pieces(plan, state, own)
    new, rows, state = update_parts(
        tx, plan, parts, state, pieces, owned_wholes(plan, params), **extra_args
    )
    return all_gather_params(new, plan.layout, tx.axis_name, tx.pack_bytes, rows), state


def bound_axis_size(axis_name: str) -> int | None:
    """Size of ``axis_name`` if it is bound here (inside ``shard_map``), else ``None``."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        return None


def context_mesh(axis_name: str) -> jax.sharding.AbstractMesh:
    """The mesh set with ``jax.set_mesh``; raises unless it has ``axis_name``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis_name not in mesh.axis_names:
        raise ValueError(
            f"zeroshard: axis {axis_name!r} is not bound. Call inside jax.shard_map over a "
            f"mesh with axis {axis_name!r}, or under `with jax.set_mesh(mesh):` (mesh axes: "
            f"{tuple(mesh.axis_names) if not mesh.empty else 'no mesh set'})."
        )
    return mesh


def sharded(
    inner: optax.GradientTransformation,
    *,
    axis_name: str = "data",
    master_dtype: Any = jnp.float32,
    reduce_dtype: Any = None,
    replica_axis: str | None = None,
    skip_nonfinite: bool = True,
    pack_bytes: int = 1 << 18,
    loss_scale: DynamicLossScale | None = None,
    stacked: Stacked = None,
    placement: Placement = None,
) -> ShardedTransformation:
    """Wraps an optax optimizer so its state lives 1/N per device (ZeRO-1).

    ``update(local_grads, state, params)`` runs inside ``jax.shard_map`` over
    ``axis_name``: it reduce-scatters (averages) the device's *local, unreduced*
    gradients (one collective per large leaf, small ones packed; see
    ``pack_bytes``), runs ``inner`` on this device's part only, and all-gathers the
    new weights in the parameters' dtype.

    Each leaf is placed where ``inner`` computes on it exactly. Where its update is
    elementwise (sgd, adam, lion, ...), the leaf is *sliced*: every device updates
    1/N of it. Where the update needs the whole tensor (per-tensor norms as in lamb,
    lars, novograd, fromage; factored moments as in adafactor; matrix functions as
    in muon), the leaf is *owned*: one device updates all of it and keeps its state,
    owners balanced by bytes or, for matrix work, by ``m * n * min(m, n)``. The
    choice is read from the traced update, per leaf (see :mod:`zeroshard.plan`). The returned
    updates are full-shape, so ``optax.apply_updates(params, updates)`` gives the
    gathered weights (exactly whenever each new weight lies within a factor two of the
    old one, by Sterbenz's lemma; otherwise within one rounding of them).

    ``init(params)`` returns this device's slices inside ``shard_map``, or global
    arrays sharded over ``axis_name`` under ``jax.set_mesh(mesh)``; it works on
    ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``).

    Args:
      inner: any optax transformation whose update treats leaves separately, or
        combines them through :func:`zeroshard.clip_by_global_norm`'s sum over the
        axis. Combining leaves otherwise (``optax.clip_by_global_norm``,
        ``optax.apply_if_finite``) is refused with a ``ValueError``.
      axis_name: the mesh axis the batch (and the state) is split over.
      master_dtype: dtype of the master weights kept for lower-precision parameters;
        ``None`` keeps no master (the inner optimizer runs in the parameters' dtype).
        Parameters already in ``master_dtype`` (or wider) need no copy.
      reduce_dtype: dtype of the gradient reduce-scatter; ``None`` uses the
        gradients' own dtype.
      replica_axis: an optional second data-parallel mesh axis to *replicate* the
        state over (hierarchical sharding, as in HSDP / MiCS): the batch is split
        over both axes, the state only over ``axis_name``. The gradients are
        reduce-scattered over ``axis_name`` and their 1/N pieces all-reduced over
        ``replica_axis``, so e.g. with ``axis_name`` within a host and
        ``replica_axis`` across hosts the slow links carry 1/N of the gradient.
      skip_nonfinite: skip the update on every device when any element of the mean
        gradient is ``nan`` or ``inf`` (a NaN on one device's local gradient reaches
        the mean): the state, master and weights stay as they were and
        ``state.skipped`` counts the step. The decision rides on the gradient-norm
        all-reduce, so all devices agree. ``False`` applies every update.
      pack_bytes: each leaf of at least this many bytes has its own reduce-scatter and
        all-gather, with no copy into or out of a packed buffer; smaller leaves of
        one dtype are packed together, up to ``pack_bytes`` per collective, so they
        do not each pay a collective's fixed cost. ``0``: one collective per leaf.
      loss_scale: dynamic loss scaling for fp16 compute (needs ``skip_nonfinite``):
        :func:`zeroshard.make_train_step` multiplies the loss by
        ``state.loss_scale.scale`` before differentiating, and the update divides the
        gradients by it; a non-finite step halves it on every device, and
        ``growth_interval`` finite steps double it. In a hand-written step, multiply
        the loss by ``opt_state.loss_scale.scale`` yourself.
      stacked: which parameters hold stacked layers (a leading layer axis, for
        scan-over-layers models): a collection of names (every leaf below a dict key
        or attribute of that name, e.g. ``["blocks"]``) or a function
        ``(path, leaf) -> number of layer axes``. Each device then holds 1/N of
        every layer, and in stage 3 ``jax.lax.scan`` over the stacked pieces gathers
        one layer per iteration (:func:`zeroshard.layer`). Numbers are the same
        either way; ``None`` (default) marks nothing.
      placement: forces leaves ``"sliced"`` or ``"owned"``: a tree like the
        parameters, or a function ``(path, leaf) -> "sliced" | "owned" | None``
        (``None``: automatic). Forcing a leaf sliced whose update needs the whole
        tensor is refused. An owned stacked leaf is owned with all its layers.

    Returns:
      A :class:`ShardedTransformation` (an ``optax.GradientTransformationExtraArgs``).

    Raises:
      ValueError: at ``init`` when ``inner`` mixes leaves, the params are empty,
        or ``axis_name`` is not bound; at ``update`` when the gradients do not match
        the params.
      TypeError: when a parameter leaf is not floating point.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zeroshard as zs
      >>> from jax.sharding import PartitionSpec as P
      >>> tx = zs.sharded(optax.adam(1e-2), axis_name="data")
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> params = {"w": jnp.ones((3, 5))}
      >>> with jax.set_mesh(mesh):
      ...     opt_state = tx.init(params)
      >>> def step(params, opt_state, x):
      ...     local = jax.lax.pcast(params, "data", to="varying")
      ...     grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(local)
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state
      >>> specs = tx.state_specs(params, jax.device_count())
      >>> step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                              out_specs=(P(), specs)))
      >>> x = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(mesh, P("data")))
      >>> params, opt_state = step(params, opt_state, x)
      >>> params["w"].shape
      (3, 5)
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"zs.sharded expects an optax GradientTransformation, got {type(inner).__name__}."
        )
    for name, axis in (("axis_name", axis_name), ("replica_axis", replica_axis)):
        if not isinstance(axis, str) and not (name == "replica_axis" and axis is None):
            raise TypeError(f"{name} must be a mesh axis name (str), got {axis!r}.")
    if replica_axis == axis_name:
        raise ValueError(
            f"replica_axis must differ from axis_name (both {axis_name!r}): the state is "
            "sharded over axis_name and replicated over replica_axis."
        )
    if loss_scale is not None:
        _check_loss_scale(loss_scale, skip_nonfinite)
    if not isinstance(pack_bytes, int) or pack_bytes < 0:
        raise ValueError(f"pack_bytes must be a non-negative int, got {pack_bytes!r}.")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: PyTree) -> ShardedState:
        if bound_axis_size(axis_name) is not None:
            return init_local(tx, params)
        return init_global(tx, params, context_mesh(axis_name))

    def update_fn(updates, state, params=None, **extra_args):
        new_params, state = apply_update(tx, updates, state, params, **extra_args)
        return jax.tree.map(lambda n, p: n - p, new_params, params), state

    tx = ShardedTransformation(init_fn, update_fn)
    tx.inner = inner
    tx.axis_name = axis_name
    tx.master_dtype = None if master_dtype is None else jnp.dtype(master_dtype)
    tx.reduce_dtype = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
    tx.replica_axis = replica_axis
    tx.skip_nonfinite = bool(skip_nonfinite)
    tx.pack_bytes = int(pack_bytes)
    tx.loss_scale = loss_scale
    tx.stacked = (
        stacked
        if stacked is None or callable(stacked)
        else tuple(sorted(set((stacked,) if isinstance(stacked, str) else stacked)))
    )
    tx.placement = placement
    tx._plans = {}
    return tx


def _check_loss_scale(loss_scale: DynamicLossScale, skip_nonfinite: bool) -> None:
    if not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            f"loss_scale must be a zs.DynamicLossScale, got {type(loss_scale).__name__}."
        )
    if not skip_nonfinite:
        raise ValueError(
            "loss_scale needs skip_nonfinite=True: a scale that is too large overflows the "
            "gradients, and that step must be skipped while the scale halves."
        )
    c = loss_scale
    if not (c.initial > 0 and c.minimum > 0 and c.factor > 1 and c.growth_interval >= 1):
        raise ValueError(
            "DynamicLossScale needs initial > 0, minimum > 0, factor > 1 and "
            f"growth_interval >= 1; got {loss_scale}."
        )
