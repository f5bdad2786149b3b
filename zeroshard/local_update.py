"""Local update: the optax wrapper that runs an inner optimizer on this device's slice.

``sharded(inner)`` chains the data flow of one step: reduce-scatter of the local
gradients, ``inner.update`` on this device's 1/N slice (moments and fp32 master live
here), and all-gather of the new weights in the parameters' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeroshard.all_gather import all_gather_params
from zeroshard.clipping import local_squares
from zeroshard.guard import check_elementwise
from zeroshard.layout import Layout, PyTree, Stacked
from zeroshard.loss_scale import DynamicLossScale, LossScaleState
from zeroshard.reduce_scatter import reduce_scatter_leaves


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one parameter tree needs, fixed at trace time.

    Attributes:
      layout: the parameters' layout over ``num_shards`` devices.
      master_dtypes: per bucket, the dtype of the master row kept in the state, or
        ``None`` where the parameters themselves are precise enough to be the master.
      state_slots: per leaf of the inner state, the index of a parameter slot whose
        pieces it is shaped like (a per-element leaf, sharded over the axis), or
        ``None`` for a replicated leaf (counts, hyperparameters).
    """

    layout: Layout
    master_dtypes: tuple[Any, ...]
    state_slots: tuple[int | None, ...]

    @property
    def inner_dtypes(self) -> list[Any]:
        """Dtype the inner optimizer works in, per bucket."""
        return [m or b.dtype for m, b in zip(self.master_dtypes, self.layout.buckets, strict=True)]

    def to_inner(self, pieces: list[jax.Array]) -> list[jax.Array]:
        """Per-leaf pieces cast to the dtype the inner optimizer works in."""
        dtypes = self.inner_dtypes
        return [p.astype(dtypes[s.bucket]) for p, s in zip(pieces, self.layout.slots, strict=True)]


class ShardedState(NamedTuple):
    """State of :func:`sharded`; every array is this device's slice or a scalar.

    Attributes:
      inner_state: the inner optimizer's state for this device's pieces.
      master: per dtype bucket, this device's row of master weights, or ``None`` where
        the parameters are already in the master dtype (their slice is the master).
      grad_norm: global L2 norm of the mean gradient at the last update, before any
        clipping (``nan`` or ``inf`` when that gradient was not finite).
      skipped: number of updates skipped because the mean gradient was not finite
        (int32; see ``skip_nonfinite`` in :func:`sharded`).
      loss_scale: the dynamic loss scale's state, or ``None`` without loss scaling.
    """

    inner_state: optax.OptState
    master: tuple[jax.Array | None, ...]
    grad_norm: jax.Array
    skipped: jax.Array
    loss_scale: LossScaleState | None = None


class ShardedTransformation(optax.GradientTransformationExtraArgs):
    """The transformation :func:`sharded` returns: an optax one that also knows its axis.

    Attributes (besides ``init`` and ``update``): ``inner``, ``axis_name``,
    ``replica_axis``, ``master_dtype``, ``reduce_dtype``, ``skip_nonfinite``,
    ``pack_bytes``, ``loss_scale`` and ``stacked`` as given to :func:`sharded`.
    """

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over: the replica axis (if any), then the
        sharding axis."""
        return (
            (self.axis_name,) if self.replica_axis is None else (self.replica_axis, self.axis_name)
        )

    def plan(self, params: PyTree, num_shards: int) -> Plan:
        """The (cached) :class:`Plan` for ``params`` over ``num_shards`` devices."""
        layout = Layout.from_tree(params, num_shards, self.stacked)
        if layout not in self._plans:
            self._plans[layout] = _make_plan(self, layout)
        return self._plans[layout]

    def state_specs(self, params: PyTree, num_shards: int) -> ShardedState:
        """``PartitionSpec`` of every leaf of the global state, for ``jax.shard_map``."""
        plan = self.plan(params, num_shards)
        pieces = jax.eval_shape(self.inner.init, plan.layout.piece_structs(plan.inner_dtypes))
        leaves, treedef = jax.tree.flatten(pieces)
        specs = [
            P() if slot is None else P(*(None,) * (leaf.ndim - 1), self.axis_name)
            for leaf, slot in zip(leaves, plan.state_slots, strict=True)
        ]
        master = tuple(None if m is None else P(self.axis_name) for m in plan.master_dtypes)
        scale = None if self.loss_scale is None else LossScaleState(P(), P())
        return ShardedState(treedef.unflatten(specs), master, P(), P(), scale)


def _make_plan(tx: ShardedTransformation, layout: Layout) -> Plan:
    master_dtypes = tuple(
        tx.master_dtype
        if tx.master_dtype is not None and jnp.finfo(b.dtype).bits < jnp.finfo(tx.master_dtype).bits
        else None
        for b in layout.buckets
    )
    inner_dtypes = [m or b.dtype for m, b in zip(master_dtypes, layout.buckets, strict=True)]
    full = layout.full_structs(inner_dtypes)
    pieces = layout.piece_structs(inner_dtypes)
    full_state = jax.eval_shape(tx.inner.init, full)
    piece_state = jax.eval_shape(tx.inner.init, pieces)
    full_leaves, full_def = jax.tree_util.tree_flatten_with_path(full_state)
    piece_leaves, piece_def = jax.tree.flatten(piece_state)
    if full_def != piece_def:
        raise ValueError(
            "zs.sharded: the inner optimizer's state has a different structure on a slice "
            "than on the full parameters, so it depends on leaf shapes and cannot be sharded."
        )
    # A state leaf is per-element iff its shape follows the pieces' shapes: probe with
    # pieces one element longer (shapes alone are ambiguous when N = 1).
    longer = layout.treedef.unflatten(
        jax.ShapeDtypeStruct((*p.shape[:-1], p.shape[-1] + 1), p.dtype)
        for p in jax.tree.leaves(pieces)
    )
    longer_leaves = jax.tree.leaves(jax.eval_shape(tx.inner.init, longer))
    per_element = {}
    for i, s in enumerate(layout.slots):
        per_element.setdefault((s.shape, s.piece_shape), i)
    state_slots = []
    for (path, f), p, q in zip(full_leaves, piece_leaves, longer_leaves, strict=True):
        sharded = p.shape != q.shape
        if sharded and (tuple(f.shape), tuple(p.shape)) in per_element:
            state_slots.append(per_element[tuple(f.shape), tuple(p.shape)])
        elif not sharded and f.shape == p.shape:
            state_slots.append(None)
        else:
            raise ValueError(
                f"zs.sharded: inner state leaf {jax.tree_util.keystr(path)} has shape "
                f"{tuple(f.shape)} for the full parameters but {tuple(p.shape)} for a slice: "
                "it is neither per-element nor independent of the parameters (e.g. a factored "
                "second moment). Use an elementwise optimizer inside zs.sharded."
            )
    check_elementwise(
        tx.inner, full, full_state, pieces, piece_state, tx.axis_name, layout.num_shards
    )
    return Plan(layout, master_dtypes, tuple(state_slots))


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
    rows = plan.layout.rows(pieces)
    master = tuple(
        None if m is None else row for m, row in zip(plan.master_dtypes, rows, strict=True)
    )
    inner_state = tx.inner.init(plan.layout.shaped(pieces))
    scale = None if tx.loss_scale is None else tx.loss_scale.init()
    zero = jnp.zeros((), jnp.float32)
    return ShardedState(inner_state, master, zero, jnp.zeros((), jnp.int32), scale)


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
    if len(state.master) != len(plan.layout.buckets):
        raise ValueError(
            "zs.sharded: the optimizer state was made for other parameters "
            f"({len(state.master)} dtype buckets, these params have "
            f"{len(plan.layout.buckets)})."
        )
    return plan


def reduce_scatter_pieces(tx: ShardedTransformation, plan: Plan, grads: PyTree) -> list[jax.Array]:
    """This device's 1-D piece of each leaf's mean gradient, in the inner dtypes.

    The local gradients are reduce-scattered over ``tx.axis_name``; with a replica axis
    the pieces are then averaged over it (an all-reduce of 1/N of the gradient).
    """
    plan.layout.check_matches(grads, "gradients")
    pieces = reduce_scatter_leaves(grads, plan.layout, tx.axis_name, tx.reduce_dtype, tx.pack_bytes)
    return plan.to_inner(mean_over_replicas(tx, pieces))


def mean_over_replicas(tx: ShardedTransformation, pieces: list[jax.Array]) -> list[jax.Array]:
    """``pieces`` averaged over ``tx.replica_axis`` (unchanged without one)."""
    if tx.replica_axis is None:
        return pieces
    return jax.lax.pmean(pieces, tx.replica_axis)


def master_pieces(plan: Plan, state: ShardedState, own: list[jax.Array]) -> list[jax.Array]:
    """This device's pieces of the master weights, one per leaf (1-D, inner dtypes).

    Args:
      plan: the plan for the parameters.
      state: this device's :class:`ShardedState`.
      own: this device's pieces of the parameters themselves (used where no separate
        master is kept).
    """
    return [
        p.astype(plan.inner_dtypes[s.bucket])
        if state.master[s.bucket] is None
        else state.master[s.bucket][s.offset : s.offset + s.piece_size]
        for p, s in zip(own, plan.layout.slots, strict=True)
    ]


def update_pieces(
    tx: ShardedTransformation,
    plan: Plan,
    grad_pieces: list[jax.Array],
    state: ShardedState,
    pieces: list[jax.Array],
    **extra_args,
) -> tuple[list[jax.Array], ShardedState]:
    """The inner update on this device's pieces: returns the new pieces and state.

    Args:
      tx: the sharded transformation.
      plan: its plan for the parameters.
      grad_pieces: this device's pieces of the mean gradient (1-D, per leaf).
      state: this device's :class:`ShardedState`.
      pieces: this device's pieces of the master weights (see :func:`master_pieces`).
      **extra_args: passed on to the inner ``update``.
    """
    layout = plan.layout
    if tx.loss_scale is not None:  # the gradients are of the scaled loss
        grad_pieces = [(g / state.loss_scale.scale).astype(g.dtype) for g in grad_pieces]
    updates, inner_state = tx.inner.update(
        layout.shaped(grad_pieces), state.inner_state, layout.shaped(pieces), **extra_args
    )
    new = [
        (p + jnp.ravel(u)).astype(p.dtype)
        for p, u in zip(pieces, layout.treedef.flatten_up_to(updates), strict=True)
    ]
    grad_norm, finite = _norm_and_finite(grad_pieces, tx.axis_name)
    skipped = state.skipped
    if tx.skip_nonfinite:
        keep = lambda a, b: jnp.where(finite, a, b)
        new = [keep(a, b) for a, b in zip(new, pieces, strict=True)]
        inner_state = jax.tree.map(keep, inner_state, state.inner_state)
        skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
    rows = layout.rows(new) if any(m is not None for m in state.master) else None
    master = tuple(None if m is None else rows[b] for b, m in enumerate(state.master))
    scale = None if tx.loss_scale is None else tx.loss_scale.adjust(state.loss_scale, finite)
    return new, ShardedState(inner_state, master, grad_norm, skipped, scale)


def _norm_and_finite(pieces: list[jax.Array], axis_name: str) -> tuple[jax.Array, jax.Array]:
    """The global L2 norm of the pieces and whether every element on every device is
    finite: one scalar all-reduce, so every device takes the same decision."""
    squares = local_squares(pieces)
    bad = sum((jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in pieces), jnp.int32(0))
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
    grad_pieces = reduce_scatter_pieces(tx, plan, grads)
    own = plan.layout.pieces(params, jax.lax.axis_index(tx.axis_name))
    pieces = master_pieces(plan, state, own)
    new, state = update_pieces(tx, plan, grad_pieces, state, pieces, **extra_args)
    return all_gather_params(new, plan.layout, tx.axis_name, tx.pack_bytes), state


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
) -> ShardedTransformation:
    """Wraps an elementwise optax optimizer so its state lives in 1/N slices (ZeRO-1).

    ``update(local_grads, state, params)`` runs inside ``jax.shard_map`` over
    ``axis_name``: it reduce-scatters (averages) the device's *local, unreduced*
    gradients (one collective per large leaf, small ones packed; see
    ``pack_bytes``), runs ``inner`` on this device's slice
    only, and all-gathers the new weights in the parameters' dtype. The returned
    updates are full-shape, so ``optax.apply_updates(params, updates)`` gives the
    gathered weights (exactly whenever each new weight lies within a factor two of the
    old one, by Sterbenz's lemma; otherwise within one rounding of them).

    ``init(params)`` returns this device's slices inside ``shard_map``, or global
    arrays sharded over ``axis_name`` under ``jax.set_mesh(mesh)``; it works on
    ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``).

    Args:
      inner: an elementwise optax transformation (adam, adamw, sgd, lion, ...).
        Transformations that mix elements (``optax.clip_by_global_norm``, lamb, lars,
        factored adafactor, muon, ...) are refused with a ``ValueError``; use
        :func:`zeroshard.clip_by_global_norm` for clipping.
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

    Returns:
      A :class:`ShardedTransformation` (an ``optax.GradientTransformationExtraArgs``).

    Raises:
      ValueError: at ``init`` when ``inner`` is not elementwise, the params are empty,
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
