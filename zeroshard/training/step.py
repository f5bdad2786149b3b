"""Step: forward and backward on the local batch, then the one update flow.

``init_train_state`` lays the state out on the mesh (optimizer state and master
weights sharded; parameters in the compute dtype, replicated over the batch axes for
stages 1 and 2 (keeping their own layout over the mesh's other axes) and
sharded for stage 3 (over every device, a tensor-parallel weight within its
blocks)); ``make_train_step`` returns a jitted ``shard_map`` step for a
ZeRO stage, with optional gradient accumulation, that donates the state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.arrival import part_specs
from zeroshard.communication.collectives import mesh_size
from zeroshard.communication.departure import departure_of
from zeroshard.communication.stage3 import full_structs, layout_of, to_shards
from zeroshard.core.branches import owned_wholes
from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import (
    check_mesh,
    each_laid_out,
    keep_axes,
    laid_out,
    own_layout,
    run_on_mesh,
)
from zeroshard.core.state_layout import StateLayout, state_layout, step_axes
from zeroshard.core.update import region
from zeroshard.optimizer.config import kept_apart
from zeroshard.optimizer.sharded import ShardedTransformation, optimizer_of
from zeroshard.optimizer.state import TrainState, key_of
from zeroshard.training import step_io
from zeroshard.training.gradient import LossRegion
from zeroshard.training.whole_mesh import Fallback

Key = jax.Array | None
"""A step's random key (``None``: none)."""
Result = tuple[TrainState, dict]
"""What a step returns: the new state and the metrics."""


def init_train_state(
    params: PyTree,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    param_dtype: Any = None,
    stage: int = 1,
    model_state: PyTree = None,
    param_specs: PyTree = None,
) -> TrainState:
    """Lays a training state out on ``mesh``.

    The master weights start from ``params`` as given (full precision), and the
    compute copy is ``params`` cast to ``param_dtype``: replicated for stages 1 and 2
    (over the batch axes; over the mesh's other axes each leaf keeps the layout its
    array in ``params`` has, e.g. ``P(None, "model")``, and the step keeps it),
    a tree of :class:`zeroshard.Piece` pieces (1/N per device) for stage 3.

    Args:
      params: the initial parameters (any placement).
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh; ``axis_name`` must be one of its axes.
      axis_name: the data-parallel axis (default: the optimizer's, ``tx.axis_name``).
      param_dtype: compute dtype of the parameters (e.g. ``jnp.bfloat16``); ``None``
        keeps the given dtypes.
      stage: the ZeRO stage the state is for (1, 2 or 3).
      model_state: non-trainable model state to carry (e.g. the ``batch_stats``
        collection of a Linen model: ``{"batch_stats": variables["batch_stats"]}``),
        replicated; the step passes it to the loss function (see
        :func:`make_train_step`).
      param_specs: the parameters' layout over ``mesh``, a ``PartitionSpec`` per leaf
        (default: their arrays' ``NamedSharding``, ``P()`` for others); over the axes
        the batch is not split over, the state keeps it (see
        :meth:`zeroshard.optimizer.sharded.Sharded.splits`).

    Returns:
      A :class:`TrainState` at step 0.

    Raises:
      TypeError: if ``tx`` is not from :func:`zeroshard.sharded`.
      ValueError: if ``mesh`` has no ``axis_name`` or it differs from the optimizer's.
    """
    check_mesh(optimizer_of(tx).config, mesh, axis_name)
    cast = lambda x: jnp.array(x, dtype=param_dtype or x.dtype, copy=True)
    structs = jax.eval_shape(partial(jax.tree.map, cast), params)
    own = own_layout(params, mesh.axis_names) if param_specs is None else param_specs
    # (over the mesh's other axes too; the stage decided once, in the config)
    built = state_layout(tx.at_stage(stage), mesh, structs, own)
    tx, plan, axis_name = built.tx, built.plan, built.axis_name
    departure = departure_of(tx.config, kept_apart(tx.config.stage)[2])
    specs = built.specs(departure)
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    if departure.pieces:  # (never the whole model on every device: see _stage3_parts)
        parts, part_specs = _stage3_parts(plan.layout, params, mesh, axis_name)

        def local_parts(parts: list, model_state: PyTree) -> TrainState:
            index, layout = jax.lax.axis_index(axis_name), plan.layout
            pieces = layout.sliced(lambda s, x: x.reshape(-1), parts)
            wholes = owned_wholes(plan, layout.treedef.unflatten(parts))
            opt_state = tx.optimizer.init_parts(plan, pieces, wholes, as_pieces=True)
            cut = lambda s, x: cast(x).reshape(-1) if not s.owned else s.cut(cast(x), index)
            shards = to_shards(
                layout, [cut(s, x) for s, x in zip(layout.slots, parts, strict=True)]
            )
            return TrainState(jnp.zeros((), jnp.int32), shards, opt_state, copy(model_state))

        return run_on_mesh(
            local_parts, mesh, axis_name, ((part_specs, P()), specs), parts, model_state
        )

    def local_init(master_params: PyTree, model_state: PyTree) -> TrainState:
        # (a split leaf's master values: the device's block)
        index, layout = jax.lax.axis_index(axis_name), plan.layout
        pieces = layout.pieces(master_params, index)
        opt_state = tx.optimizer.init_parts(plan, pieces, owned_wholes(plan, master_params))
        params = jax.tree.map(cast, master_params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, copy(model_state))

    # The same out_specs as the step's, so the first step sees the shardings it returns;
    # the parameters keep their own layout over the state's other axes (the step does).
    in_specs = (specs.params, P())
    state = run_on_mesh(local_init, mesh, axis_name, (in_specs, specs), params, model_state)
    return laid_out_as(state, built.weight_specs, mesh)


def laid_out_as(state: TrainState, specs: PyTree, mesh: jax.sharding.Mesh) -> TrainState:
    """``state`` with its weights laid out as ``specs`` say (a ``PartitionSpec`` per
    leaf, over the mesh's axes the batch is not split over: tensor parallelism's
    ``"model"``, say, as :class:`TrainStep` keeps them; ``P()`` leaves as they are)."""
    if not any(any(spec) for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        return state  # (none)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)) if any(spec) else x
    return state._replace(params=jax.tree.map(put, state.params, specs))


def _stage3_parts(layout: Any, params: PyTree, mesh: Any, axis_name: str) -> tuple[list, list]:
    """Every device's piece of each sliced leaf, laid out on ``mesh`` one leaf at a time
    (``(num_shards, piece_size)``, row ``d`` on device ``d``), and the owned leaves whole
    (replicated): the parts a stage-3 state is made from. Cutting the pieces leaf by
    leaf keeps at most one leaf whole per device while the state is laid out; laying
    the whole tree out on every device first would need more memory than training."""
    rows = NamedSharding(mesh, P(axis_name))
    whole = NamedSharding(mesh, P())
    parts, specs, cutters = [], [], {}
    for s, x in zip(layout.slots, layout.treedef.flatten_up_to(params), strict=True):
        if s.owned:
            parts.append(jax.device_put(x, whole)), specs.append(P())
            continue
        # One program per geometry, not per leaf (a jit of each leaf's own method
        # compiled 512 times for 512 leaves: most of a stage-3 start).
        geometry = dataclasses.replace(s, path="")
        if geometry not in cutters:
            cutters[geometry] = jax.jit(geometry.blocks, out_shardings=rows)
        # (the leaf whole on every device for a moment: its pieces' layout is not its own)
        parts.append(cutters[geometry](jax.device_put(x, whole)))
        specs.append(P(axis_name))
    return parts, specs


@dataclasses.dataclass(eq=False)
class TrainStep:
    """A jitted data-parallel training step; see :func:`make_train_step`, which
    takes the same arguments and checks them.

    Call it as ``state, metrics = train_step(state, batch)``; ``lower(state, batch)``
    gives the ``jax.stages.Lowered`` program (for HLO inspection) and ``jitted`` the
    underlying ``jax.jit`` function, ``jitted(state, batch, key, layout=None)``:
    ``layout``, static, is the parameters' layout over the mesh's other axes as a
    tuple of ``PartitionSpec`` (one per leaf) that the step returns them in; the call
    reads it from ``state.params``, ``None`` returns them replicated. Where the state
    spans the mesh's other axes, the step is jitted once per tree structure of the
    state, returning it laid out as it was made (``out_shardings``: the types of a
    mesh with Explicit and Auto axes say only the Explicit ones), and ``jitted`` is
    the function of the state last stepped or lowered.

    A loss whose own sharding calls fail per device (they name the batch axis, pass a
    ``PartitionSpec`` to ``reshard``, or leave it with ``auto_axes``) runs on the whole
    mesh instead (:mod:`zeroshard.training.whole_mesh`), without micro-batches.
    """

    loss_fn: Callable[..., Any]
    tx: ShardedTransformation
    mesh: jax.sharding.Mesh
    axis_name: str | None = None
    has_aux: bool = False
    donate: bool = True
    stage: int = 1
    accum_steps: int = 1

    def __post_init__(self) -> None:
        k = self.accum_steps
        self.axis_name = check_mesh(optimizer_of(self.tx).config, self.mesh, self.axis_name)
        # The stage decided once, in the config the step carries (and its state's)
        self.tx = self.tx.at_stage(self.stage)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"accum_steps must be a positive integer, got {k!r}.")
        self.opt, axes = self.tx.optimizer, self.tx.config.batch_axes
        # The state's axes: the batch's, and the mesh's others (e.g. a tensor-parallel
        # "model" axis), over which the update runs manual too (rest).
        self.state_tx, self.rest = step_axes(self.tx, self.mesh)
        self.num_shards = mesh_size(self.mesh, self.state_tx.axis_name)  # (the state's)
        # The micro-batches run over the batch axes; with other axes, the gradients
        # arrive manual over those axes too (nested), and the update region runs manual
        # over every axis.
        self.route = self.state_tx.optimizer.route_of(accum_steps=k, batch_axes=axes)
        self.batch_axes = self.route.loop.axes
        self.batch_parts = math.prod(self.mesh.shape[a] for a in axes)
        self.route.loop.check(self.batch_parts)
        self.opt.config.sum_order.check_devices(self.num_shards, self.state_tx.axis_name)
        self._fallback = Fallback(self)  # (see the class)
        loss = self._fallback.refusals.loss
        self.loss_region = LossRegion(
            loss, self.has_aux, self.opt.config, self.route, self.rest, self.mesh
        )
        self._jits: dict[Any, Any] = {}
        self._last: Any = None

    def state_specs(self, params: PyTree, layout: tuple | None = None) -> TrainState:
        """The ``PartitionSpec``s of the global state this step takes for ``params``
        (see :meth:`layout_for`)."""
        return self.layout_for(params, layout).specs(self.route.departure)

    def layout_for(self, params: PyTree, layout: tuple | None = None) -> StateLayout:
        """The state's layout (:class:`zeroshard.core.state_layout.StateLayout`) for
        ``params`` with the weights laid out over the mesh's other axes as ``layout``
        (a ``PartitionSpec`` per leaf; ``None``: replicated), built once per
        structure, shapes and layout (:func:`zeroshard.core.state_layout.state_layout`)."""
        structs = full_structs(params)
        treedef = jax.tree.structure(structs)
        weights = treedef.unflatten(layout or [P()] * treedef.num_leaves)
        return state_layout(self.tx, self.mesh, structs, weights)

    def _global_step(
        self, state: TrainState, batch: PyTree, key: Key, layout: Any = None
    ) -> Result:
        self.route.loop.check_batch(batch, self.batch_parts)
        pieces = self.route.departure.pieces
        if key_of(state.opt_state).pieces != pieces:  # (as the state says it holds them)
            raise ValueError(
                f"this is a stage-{self.opt.config.stage} step, but the state's params are "
                f"{'replicated (stage 1/2)' if pieces else 'pieces (stage 3)'}: build "
                f"the state with zs.init_train_state(..., stage={self.opt.config.stage})."
            )
        built = self.layout_for(state.params, layout)
        built.tx.optimizer.check_state(built.plan, state.opt_state)  # (made for this layout)
        specs = keep_axes(built.specs(self.route.departure), self.opt.config.batch_axes)
        if layout is not None:  # (a static tuple of specs, one per leaf)
            layout = jax.tree.structure(state.params).unflatten(layout)
        extras = (state.model_state, state.opt_state.loss_scale, {})
        parts, extra, metrics, model_state = self.loss_region(
            built.plan, specs.params, state.params, batch, key, extras
        )
        opt, route = built.tx.optimizer, self.loss_region.taken
        specs = built.specs(route.departure)  # (whole over the other axes, or a block)
        params = each_laid_out(state.params, specs.params, self.mesh)
        parts_at = part_specs(built.plan, self.loss_region.part_axes)
        specs = (parts_at, specs.opt_state, specs.params, specs.params)
        update = region(opt, built.plan, route, self.mesh, specs, check_vma=self.num_shards > 1)
        params, opt_state = update(parts, state.opt_state, params, extra)
        if layout is not None and not route.departure.pieces:  # (the weights' own layout)
            params = laid_out(params, layout, self.mesh)
        metrics = step_io.update_metrics(self.opt.config, (state.opt_state, opt_state), metrics)
        return TrainState(state.step + 1, params, opt_state, model_state), metrics

    def _place(self, batch: PyTree) -> PyTree:
        """``batch`` split over the batch axes; abstract values (``jax.ShapeDtypeStruct``,
        to :meth:`lower` the step without data) given that sharding, not placed."""
        self.route.loop.check_batch(batch, self.batch_parts)
        return step_io.placed(batch, NamedSharding(self.mesh, P(self.batch_axes)))

    def static_layout(self, specs: PyTree) -> tuple[P, ...] | None:
        """``specs`` (a ``PartitionSpec`` per leaf; the weights' own layout, which the
        step keeps) over the state's other axes (tensor parallelism's ``"model"``, say),
        as the jitted step's static ``layout`` argument (one compilation per layout;
        ``None`` where there are no such axes)."""
        if not self.rest:
            return None
        return tuple(
            jax.tree.leaves(keep_axes(specs, self.rest), is_leaf=lambda x: isinstance(x, P))
        )

    @property
    def jitted(self) -> Any:
        """The ``jax.jit`` function of the step (see the class's description)."""
        return self._jits.get(self._last) or self._jitted_for(None, None)

    def _jitted_for(self, state: TrainState | None, layout: tuple | None) -> Any:
        """The jitted step for states shaped as ``state`` with the weights' ``layout``:
        one for every state where the state spans the batch axes alone, else one per
        tree structure and layout, returning the state laid out as :meth:`state_specs`
        and ``layout`` say."""
        key = None if state is None or not self.rest else (jax.tree.structure(state), layout)
        if key not in self._jits:
            options = dict(static_argnums=3, donate_argnums=(0,) if self.donate else ())
            if key is not None:
                options["out_shardings"] = (self._shardings(state, layout), None)
            self._jits[key] = jax.jit(self._global_step, **options)
        self._last = key
        return self._jits[key]

    def _shardings(self, state: TrainState, layout: tuple | None) -> TrainState:
        """The ``NamedSharding`` of each leaf of ``state`` as the step returns it."""
        specs = self.layout_for(state.params, layout).returned(self.route.departure)
        named = lambda spec: NamedSharding(self.mesh, spec)
        return jax.tree.map(named, specs, is_leaf=lambda x: isinstance(x, P))

    def __call__(self, state: TrainState, batch: PyTree, key: Key = None) -> Result:
        state, metrics = self._run(state, batch, key, lower=False)
        return state, step_io.plain_outputs(metrics, self.mesh)

    def lower(self, state: TrainState, batch: PyTree, key: Key = None) -> jax.stages.Lowered:
        """Lowers the step for ``state`` and ``batch`` without running it (arrays, or
        ``jax.ShapeDtypeStruct`` with the state's shardings: see
        :func:`zeroshard.step_memory`)."""
        return self._run(state, batch, key, lower=True)

    def _run(self, state: TrainState, batch: PyTree, key: Key, lower: bool) -> Any:
        layout = self.static_layout(layout_of(state.params, self.rest))
        step = self._jitted_for(state, layout)
        run = lambda: (step.lower if lower else step)(state, self._place(batch), key, layout)
        return self._fallback.run(run, lower, state, batch, key)  # (see the class)


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    has_aux: bool = False,
    donate: bool = True,
    stage: int = 1,
    accum_steps: int = 1,
) -> TrainStep:
    """Builds a jitted ZeRO training step.

    Each device computes the loss and gradients of ``loss_fn`` on its share of the
    batch, then the sharded optimizer reduce-scatters the gradients, updates its
    slice and all-gathers the new weights.

    With ``accum_steps`` > 1 each device's share is split into that many micro-batches
    whose gradients are averaged before the update. ``stage`` chooses how: stage 1
    keeps a full-size fp32 gradient accumulator and reduce-scatters once per step;
    stage 2 reduce-scatters every micro-batch into a 1/N fp32 accumulator, so no
    full-size gradient buffer outlives a micro-batch (the same bytes per micro-batch
    as one all-reduce). Without accumulation both are the same step, unless the loss
    gathers (below).

    Stage 2 through a loss that gathers: when ``loss_fn`` reads every parameter only
    through :func:`zeroshard.gather` or :func:`zeroshard.layer` (read from the loss
    traced once more, at trace time; nothing to declare), a stage-2 step hands it
    :class:`zeroshard.communication.stage3.Held` leaves (the weights whole, as before, and this
    device's piece). Their gather has no collective; its transpose reduce-scatters
    each gathered layer's gradient as stage 3's does, so the full gradient of every
    layer is never held at once (:mod:`zeroshard.training.held`). With ``accum_steps`` the
    pieces are accumulated as in stage 3; ``quantize_grads`` quantizes those
    reduce-scatters. A loss that reads a parameter any other way, the fixed-order step
    of ``deterministic=`` and the NNX step run the plain stage-2 step, unchanged.

    Stage 3 keeps the weights as 1/N pieces too (a state from
    ``init_train_state(..., stage=3)``): ``loss_fn`` receives a tree of
    :class:`zeroshard.Piece` and gathers each layer's weights right before use with
    :func:`zeroshard.gather` or :func:`zeroshard.layer` (which also re-gathers them in the
    backward pass instead of keeping them). The gather's transpose reduce-scatters
    the gradients, so they arrive as pieces, and no all-gather closes the step.

    Stacked layers (``zs.sharded(..., stacked=["blocks"])``) are cut layer by layer,
    so in stage 3 ``jax.lax.scan`` over them with :func:`zeroshard.layer` in the body
    gathers one layer per iteration.

    Randomness and model state: ``train_step(state, batch, key)`` passes ``key=`` to
    ``loss_fn``, folded with the device's index over the batch axes (and with the
    micro-batch index when accumulating): every device draws its own dropout masks,
    and the same key gives the same run. A state built with
    ``init_train_state(..., model_state=...)`` (e.g. BatchNorm statistics) passes
    ``model_state=`` too; ``loss_fn`` then returns ``(loss, new_model_state)`` (with
    ``has_aux``: ``(loss, (new_model_state, aux))``, Flax's ``mutable=`` convention),
    and the new state, averaged over the batch axes, is the state's ``model_state``.

    With ``zs.sharded(..., loss_scale=...)`` the step differentiates the loss times
    the current scale; the reported loss is unscaled.

    Args:
      loss_fn: ``loss_fn(params, batch, **extras) -> scalar`` (or ``(scalar, aux)``
        with ``has_aux``): the mean loss over the batch it is given. ``extras`` are
        ``key=`` when the step is given a key and ``model_state=`` when the state
        has one (see above).
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh.
      axis_name: the axis the state is sharded over (default: ``tx.axis_name``);
        the batch's leading dimension
        is split over it, and over ``tx.config.replica_axis`` too when the optimizer has one
        (hierarchical sharding). Other mesh axes are left to ``loss_fn``.
      has_aux: whether ``loss_fn`` returns aux, into ``metrics["aux"]``: leaves with a
        leading dimension of the device's batch size are per-example and come back
        as the global arrays, in batch order; other leaves are averaged over devices.
      donate: donate the input state's buffers to the output state.
      stage: 1, 2 or 3 (ZeRO stage; see above).
      accum_steps: micro-batches per step; the global batch must divide by
        ``accum_steps`` times the axis size.

    Returns:
      A :class:`TrainStep`: ``state, metrics = train_step(state, batch[, key])``, where
      ``metrics`` holds replicated scalars (and ``"aux"``, see ``has_aux``):

      - ``"loss"``: the global mean loss (unscaled under loss scaling);
      - ``"grad_norm"``: the global norm of the mean gradient, before clipping
        (``nan``/``inf`` when it was not finite);
      - ``"skipped"`` (with ``skip_nonfinite``, the default): int32, 1 when this step's
        update was skipped because the mean gradient was not finite, else 0; its sum
        is ``state.opt_state.skipped``, the running count;
      - ``"loss_scale"`` (with ``zs.sharded(..., loss_scale=...)``): the scale this
        step's loss was multiplied by (it halves after a skipped step).

    Profiling: the step's parts run in named scopes (:mod:`zeroshard.measuring.scopes`), so a
    profile (``jax.profiler``) and the compiled program's op names
    (``train_step.lower(state, batch).compile().as_text()``) tell them apart:
    ``zeroshard/reduce_scatter``, ``zeroshard/grad_norm``, ``zeroshard/update``,
    ``zeroshard/all_gather``; in stage 3 ``zeroshard/gather`` (and its transpose,
    the gradients' reduce-scatter), ``zeroshard/to_owners``, ``zeroshard/from_owners``;
    ``zeroshard/replica_mean`` with a replica axis; ``zeroshard/metrics`` and
    ``zeroshard/model_state``. The loss function's own operations keep their names.

    Raises:
      TypeError: if ``tx`` is not from :func:`zeroshard.sharded`.
      ValueError: if ``mesh`` has no ``axis_name`` (or no ``tx.config.replica_axis``), or has
        another Explicit axis this jax cannot lower the step next to; at call time,
        if a batch leaf's leading dimension is not divisible by the batch axes' size.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zeroshard as zs
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = zs.sharded(optax.sgd(0.1), axis_name="data")
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> state = zs.init_train_state({"w": jnp.zeros((2, 1))}, tx, mesh)
      >>> train_step = zs.make_train_step(loss_fn, tx, mesh)
      >>> batch = {"x": jnp.ones((8, 2)), "y": jnp.ones((8, 1))}
      >>> state, metrics = train_step(state, batch)
      >>> float(metrics["loss"]), int(state.step)
      (1.0, 1)
      >>> sorted(metrics), int(metrics["skipped"])
      (['grad_norm', 'loss', 'skipped'], 0)
    """
    return TrainStep(loss_fn, tx, mesh, axis_name, has_aux, donate, stage, accum_steps)
