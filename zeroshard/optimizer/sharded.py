"""Sharded: the optax wrapper ``zs.sharded(inner, **options)`` and its state.

The transformation is an ordinary ``optax.GradientTransformationExtraArgs``. Its
``init`` and ``update`` are the methods of a frozen :class:`Sharded`: the inner
optimizer and a :class:`zeroshard.ShardConfig`. ``init`` lays the state out 1/N per
device; ``update`` is the one update flow of :mod:`zeroshard.core.update` (reduce-scatter,
the inner update on this device's part, all-gather). The plan for a parameter tree
(:mod:`zeroshard.core.placement`) is built once per optimizer and layout, in a cache of
this module, not on the transformation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeroshard.analysis import check_extra_args
from zeroshard.communication.collectives import axes_of, mesh_size
from zeroshard.communication.jit_pieces import apply_in_jit, init_pieces, shard_params
from zeroshard.communication.stage3 import full_structs, is_shard
from zeroshard.core.branches import init_parts, owned_wholes
from zeroshard.core.layout import WHOLE, Layout, PyTree, Split
from zeroshard.core.mesh import (
    bound_axis_size,
    each_laid_out,
    find_mesh,
    on_mesh,
    typed_layout,
)
from zeroshard.core.placement import Plan, make_plan
from zeroshard.core.update import Grads, Route, updated
from zeroshard.optimizer.annotations import annotated, unboxed
from zeroshard.optimizer.config import ShardConfig, kept_apart
from zeroshard.optimizer.loss_scale import LossScaleState
from zeroshard.optimizer.state import LayoutKey, ShardedState, key_of
from zeroshard.training import gradient

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Sharded:
    """A sharded optimizer: ``inner`` run on each device's part, as ``config`` says.

    Attributes:
      inner: the inner optax transformation (with extra-args support).
      config: the options of :func:`sharded`.
    """

    inner: optax.GradientTransformationExtraArgs
    config: ShardConfig

    def plan(
        self, params: PyTree, num_shards: int, splits: Mapping[int, Split] | None = None
    ) -> Plan:
        """The (cached) :class:`zeroshard.core.placement.Plan` for ``params`` (arrays,
        ``ShapeDtypeStruct`` or stage-3 pieces) over ``num_shards`` devices, with the
        leaves of ``splits`` (:meth:`splits`) kept block by block."""
        config, structs = self.config, full_structs(params)
        align = 0 if config.state_store is None else config.state_store.block
        layout = Layout.from_tree(
            structs,
            num_shards,
            config.stacked,
            chunks=config.sum_order.chunks,
            splits=splits,
            align=align,
        )
        return _plan(self, layout)

    def splits(
        self, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, specs: PyTree
    ) -> dict[int, Split]:
        """The leaves whose state zeroshard's step on ``mesh`` keeps by Megatron's rule
        (:class:`zeroshard.core.layout.Split`), by index: those that ``specs`` (the weights'
        layout, a ``PartitionSpec`` per leaf) split along one dimension over every axis
        of :meth:`other_axes`. Their gradients are
        reduce-scattered, and their weights all-gathered, over the batch axes only,
        within the device's block; the other leaves are gathered whole for the update.
        (The layout module keeps a split only for a leaf it can cut block by block.)
        On a mesh without the batch axes (the drop-in's default ``"data"`` on an
        ``("fsdp", "tensor")`` mesh) there is no batch to cut a block over: none."""
        others, config = self.other_axes(mesh), self.config
        if not set(config.batch_axes) & set(mesh.axis_names):
            return {}
        specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        named = [[(k, axes_of(e)) for k, e in enumerate(spec) if e is not None] for spec in specs]
        split = lambda n: Split(n[0][0], others, mesh_size(mesh, others), config.axes)
        return {i: split(n) for i, n in enumerate(named) if [a for _, a in n] == [others]}

    def specs_of(self, plan: Plan, as_pieces: bool = False) -> ShardedState:
        """``PartitionSpec`` of every leaf of the global state ``plan`` lays out (beside
        weights held ``as_pieces``: :attr:`zeroshard.optimizer.state.LayoutKey.pieces`)."""
        axis = self.config.axis_name
        specs = [x.spec(plan, k, axis) for k, x in enumerate(plan.state_kinds)]
        master = plan.master_tree([s.spec(axis) for s in plan.layout.slots])
        scale = None if self.config.loss_scale is None else LossScaleState(P(), P())
        owned = tuple(P(axis) for _ in plan.storage.dtypes)
        key = LayoutKey.of(self.config.axes, plan.layout, as_pieces)
        inner = plan.state_treedef.unflatten(specs)
        return ShardedState(inner, master, P(), P(), scale, owned, key)

    def spanning(self, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> Sharded:
        """This optimizer with its state split over every axis of ``mesh`` but the
        replica axis: the one-line drop-in's. Where ``update`` takes the mean gradient
        (reduced already, the same on every device), nothing ties the state to the
        batch's axes, so each of the N devices keeps 1/N of it, whatever the mesh and
        whatever the parameters' own layout over it (tensor parallelism, FSDP)."""
        return self.over(tuple(a for a in mesh.axis_names if a != self.config.replica_axis))

    def for_step(self, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> Sharded:
        """This optimizer as zeroshard's step on ``mesh`` lays its state out: over its
        ``axis_name`` and over every other axis of ``mesh`` but the replica axis too (a
        tensor-parallel ``"model"`` axis, say: the step's update then runs manual over
        those axes as well, each device updating 1/N of every leaf; at stage 3 its
        weights are cut so too, and :func:`zeroshard.gather` runs manual over those
        axes as well)."""
        return self.over((*self.config.axes, *self.other_axes(mesh)))

    def other_axes(self, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> tuple[str, ...]:
        """The axes of ``mesh`` that zeroshard's step splits the state over besides the
        batch's (:meth:`for_step`): over them the parameters keep their own layout."""
        return tuple(a for a in mesh.axis_names if a not in self.config.batch_axes)

    def over(self, axes: tuple[str, ...]) -> Sharded:
        """This optimizer with its state split over ``axes`` (itself, where they are
        its own ``axis_name``'s, or none are given)."""
        return _over(self, tuple(axes) or self.config.axes)

    def at_stage(self, stage: int) -> Sharded:
        """This optimizer at ZeRO ``stage`` (itself, where it is its own): how
        zeroshard's step and its state take their ``stage=``, decided once in the
        config, which every reader of the step or the state asks.

        Raises:
          ValueError: for a stage other than 1, 2 or 3.
        """
        return _at_stage(self, stage)

    def init(self, params: PyTree) -> ShardedState:
        """``tx.init``: this device's state inside ``shard_map`` over the axis; else the
        global state, 1/N per device of every axis (:meth:`spanning`), on the mesh of
        :func:`zeroshard.core.mesh.find_mesh` (eagerly, or inside the user's ``jax.jit``).
        Parameters in Flax's boxes (Linen's ``Partitioned``, NNX ``Variable`` nodes) give
        a state whose leaves are in boxes of the same kind naming their own layout
        (:mod:`zeroshard.optimizer.annotations`)."""
        boxed, (params, _) = params, unboxed(params)
        if bound_axis_size(self.config.axis_name) is not None:
            return self.init_local(params)
        try:
            mesh = find_mesh(self.config, params, any_axes=True)
        except ValueError as error:
            error.add_note(NO_MESH)
            raise
        three = kept_apart(self.config.stage)[2]  # (stage 3: from the pieces, never whole)
        if three:  # (on the mesh as given: spanning it, every axis is the batch's)
            self.config.check_in_jit(mesh, pieces=True, grads=False)
        opt, splits = self.spanning(mesh), self.typed_splits(mesh, params)
        plan = opt.plan(params, mesh_size(mesh, opt.config.axis_name), splits)
        specs, leaves = opt.specs_of(plan), plan.layout.leaf_specs()
        # (each leaf whole, or a split leaf's block; laid out so, or not placed)
        local = functools.partial(opt.init_local, plan=plan)
        if three:
            params, leaves, local = init_pieces(opt, plan, params, mesh)
        init = on_mesh(local, mesh, mesh.axis_names, ((leaves, P()), specs))
        state = init(each_laid_out(params, leaves, mesh), None)
        return annotated(state, specs, boxed)

    def typed_splits(self, mesh: Any, params: PyTree, made: Any = None) -> dict[int, Split]:
        """The one-line drop-in's :meth:`splits` on ``mesh``: those its parameters'
        layouts show (:func:`zeroshard.core.mesh.typed_layout`). A split leaf's mean
        gradient is cut within its block, and its new weights all-gathered over the
        batch axes only, so its gradient never crosses the other axes. Where they
        show none (a traced weight on Auto axes carries no layout), ``tx.update``
        takes those the state was ``made`` with (its :class:`LayoutKey`: ``tx.init``
        saw the placed weights)."""
        others = self.other_axes(mesh)  # (a padded weight: as its record says)
        own = lambda x: x.split.leaf_spec(len(x.shape)) if is_shard(x) else typed_layout(x, others)
        splits = self.splits(mesh, jax.tree.map(own, params, is_leaf=is_shard))
        return made.by_leaf if made is not None and not splits else splits

    def init_local(
        self,
        params: PyTree,
        master_params: PyTree | None = None,
        plan: Plan | None = None,
    ) -> ShardedState:
        """This device's state, inside ``shard_map`` over the sharding axis.

        Args:
          params: the full parameters in their compute dtype (a leaf the plan splits:
            this device's block of it).
          master_params: optional full-precision values to start the master weights
            from (default: ``params``).
          plan: the plan of the global parameters (default: ``params``'s).
        """
        axis = self.config.axis_name
        plan = plan or self.plan(params, jax.lax.axis_size(axis))
        source = params if master_params is None else master_params
        plan.layout.check_matches(source, "master_params")
        pieces = plan.layout.pieces(source, jax.lax.axis_index(axis))
        return self.init_parts(plan, pieces, owned_wholes(plan, source))

    def init_parts(
        self, plan: Plan, pieces: list, wholes: list, as_pieces: bool = False
    ) -> ShardedState:
        """This device's state from its 1-D pieces of the sliced leaves' master values
        (``None`` at owned leaves) and the owned leaves' full ones
        (:func:`zeroshard.core.branches.owned_wholes`), inside ``shard_map``, beside weights
        held ``as_pieces`` (:attr:`zeroshard.optimizer.state.LayoutKey.pieces`)."""
        axis = self.config.axis_name
        cast = lambda s, p: p.astype(plan.inner_dtypes[s.bucket])  # (the inner dtypes)
        pieces = plan.on_view.grouped(plan.layout.sliced(cast, pieces))
        master = plan.master_tree(pieces)
        inner_state, owned = init_parts(self.inner, plan, axis, pieces, wholes)
        scale = None if self.config.loss_scale is None else self.config.loss_scale.init()
        zero = jnp.zeros((), jnp.float32)
        key = LayoutKey.of(self.config.axes, plan.layout, as_pieces)
        return ShardedState(inner_state, master, zero, jnp.zeros((), jnp.int32), scale, owned, key)

    def update(
        self, updates: PyTree, state: ShardedState, params: PyTree = None, **extra_args: Any
    ) -> tuple[PyTree, ShardedState]:
        """``tx.update``: full-shape updates out, such that ``optax.apply_updates(params,
        updates)`` gives the new weights. Inside ``shard_map`` over the axis the
        gradients are each device's local ones (:meth:`apply`); anywhere else they are
        the mean gradient, its partial sums (weights typed ``reduced``) or
        ``tx.value_and_grad``'s parts
        (:func:`zeroshard.communication.jit_pieces.apply_in_jit`). ``extra_args``
        (e.g. ``value=``) reach the inner update; a function among them is refused
        (:func:`zeroshard.analysis.check_extra_args`).

        Raises:
          ValueError: with ``deterministic=``, which only a zeroshard step provides;
            without ``params``.
          TypeError: for a state this transformation's ``init`` did not make.
        """
        new, state, (params, like) = self.stepped(updates, state, params, extra_args)
        return like(jax.tree.map(lambda n, p: n - p, new, params)), state

    def stepped(self, updates: PyTree, state: Any, params: PyTree, extra_args: dict) -> tuple:
        """The new weights (:meth:`update` returns them less ``params``,
        ``tx.apply_gradients`` as they are), the new state (in the boxes it came in),
        and the weights unboxed with the function that boxes a tree like them."""
        check_extra_args(extra_args)
        given = isinstance(updates, Grads)  # (tx.value_and_grad's: reduced by zeroshard)
        if not given:
            self.config.sum_order.check_drop_in()
        (state, reboxed), (params, like) = unboxed(state), unboxed(params)
        self.check_arguments(state, params)
        local = bound_axis_size(self.config.axis_name) is not None
        grads = updates if given else unboxed(updates)[0]
        if local and not given:
            new, state = self.apply(grads, state, params, **extra_args)
        else:
            new, state = apply_in_jit(self, grads, state, params, extra_args)
        return new, reboxed(state), (params, like)

    def apply(
        self, grads: PyTree, state: ShardedState, params: PyTree, **extra_args: Any
    ) -> tuple[PyTree, ShardedState]:
        """One sharded step inside ``shard_map`` (:mod:`zeroshard.core.update`): this device's
        local, unreduced ``grads`` in; the new parameters, laid out as ``params`` (the
        state says whether as stage 3's pieces), and the new state out."""
        return self._local_update(grads, state, params, extra_args)

    def in_jit(
        self, tree: PyTree, params: PyTree, grads: bool = True
    ) -> tuple[Sharded, Plan, jax.sharding.Mesh]:
        """The drop-in's optimizer (:meth:`spanning`), its plan for ``params`` and
        the mesh (``tree``'s, see :func:`zeroshard.core.mesh.find_mesh`), at stages 2
        and 3 (:mod:`zeroshard.communication.jit_pieces`; what they refuse:
        :meth:`zeroshard.optimizer.config.ShardConfig.check_in_jit`, with ``grads``
        what ``jax.grad``'s gradient cannot take too)."""
        mesh = find_mesh(self.config, tree, any_axes=True)
        self.config.check_in_jit(mesh, kept_apart(self.config.stage)[2], grads)
        made = tree.layout if isinstance(tree, ShardedState) else None  # (in tx.update)
        return *self.spanned(mesh, params, made), mesh

    def spanned(
        self, mesh: Any, params: PyTree, made: Any = None, splits: Mapping[int, Split] | None = None
    ) -> tuple[Sharded, Plan]:
        """The drop-in's optimizer on ``mesh`` (:meth:`spanning`) and its plan for
        ``params``, its leaves of ``splits`` kept block by block (default: the
        drop-in's, :meth:`typed_splits`, for a state ``made`` so, if given)."""
        splits = self.typed_splits(mesh, params, made) if splits is None else splits
        opt = self.spanning(mesh)
        return opt, opt.plan(params, mesh_size(mesh, opt.config.axis_name), splits)

    def route_of(self, stage: int | None = None, mean: bool = False, **options: Any) -> Route:
        """The route (:meth:`zeroshard.core.update.Route.of`, its ``options`` too) of a
        step or ``tx.update`` for weights held as at ``stage`` (default: the
        config's): each device's local gradients, or with ``mean`` the mean gradient
        (``tx.update`` in a ``jax.jit``)."""
        return Route.of(self.config, stage, mean=mean, **options)

    def _local_update(
        self, grads: PyTree, state: ShardedState, params: PyTree, extra_args: dict
    ) -> tuple[PyTree, ShardedState]:
        """The update flow inside a user's ``shard_map`` (:meth:`apply`): this device's
        local ``grads``, the weights held as the state says, by the plan of the
        arguments."""
        route = self.route_of(3 if key_of(state).pieces else 1)
        plan = self.plan(params, jax.lax.axis_size(self.config.axis_name))
        self.check_state(plan, state)
        parts = route.arrival.bring(plan, grads)
        return updated(self.inner, self.config, plan, route, parts, state, params, **extra_args)

    def check_arguments(self, state: ShardedState, params: PyTree) -> None:
        """Refuses ``tx.update`` without ``params``, or with another state."""
        if params is None:
            raise ValueError(
                "zs.sharded(...).update needs `params` (the current full parameters): "
                "call tx.update(grads, opt_state, params)."
            )
        if not isinstance(state, ShardedState):
            kinds = state if isinstance(state, tuple) else (state,)
            raise TypeError(
                "zs.sharded(...).update got an optimizer state of "
                f"{', '.join(type(x).__name__ for x in kinds)}, not a zeroshard one (was it "
                "made by another optimizer's init, e.g. the inner optax one's?): make it with "
                "the same transformation, opt_state = tx.init(params), or convert a plain "
                "optax state with zs.from_optax_state."
            )

    def check_state(self, plan: Plan, state: ShardedState) -> None:
        """Refuses a ``state`` made for other parameters than ``plan``'s, or laid out
        otherwise than this optimizer lays it out by ``plan`` (the layout it carries,
        :class:`zeroshard.optimizer.state.LayoutKey`: over other axes, or a leaf kept in other
        blocks: made for the weights laid out otherwise than they are now)."""
        master = jax.tree.structure(plan.master_tree([0] * len(plan.layout.slots)))
        mine = jax.tree.structure(state.master)
        if mine != master or len(state.owned) != len(plan.storage.dtypes):
            raise ValueError(
                "zs.sharded: the optimizer state was made for other parameters: its master "
                f"weights have the structure {mine}, these params need {master}."
            )
        check_made(plan.layout, key_of(state), self.config.axes, plan.layout.splits)


NO_MESH = (
    "zeroshard: tx.init lays the state out on a mesh, and none is known where it runs "
    "(under jax.eval_shape, or in a jit that makes the parameters, they carry no "
    "layout). Give the optimizer its mesh: zs.sharded(inner, mesh=mesh); a program "
    "that computes the state's shardings from annotations (nn.get_partition_spec of "
    "jax.eval_shape(init)) needs it there, or under `with jax.set_mesh(mesh):`."
)


@functools.lru_cache(maxsize=256)
def _over(opt: Sharded, axes: tuple[str, ...]) -> Sharded:
    if axes == opt.config.axes:
        return opt
    return Sharded(opt.inner, dataclasses.replace(opt.config, axis_name=axes))


@functools.lru_cache(maxsize=256)
def _at_stage(opt: Sharded, stage: int) -> Sharded:
    config = opt.config.at_stage(stage)
    return opt if config is opt.config else Sharded(opt.inner, config)


@functools.lru_cache(maxsize=256)
def _plan(opt: Sharded, layout: Layout) -> Plan:
    plan = make_plan(opt.inner, opt.config, layout)
    _log_owned(plan)
    return plan


def _log_owned(plan: Plan) -> None:
    """One line at init when leaves are owned: how many, and the load per device."""
    owned = [s for s in plan.layout.slots if s.owned]
    if not owned:
        return
    nbytes, costs = plan.owned_bytes(), plan.owned_costs()
    mean = sum(costs) / len(costs)
    logger.info(
        f"zeroshard: {len(owned)} of {len(plan.layout.slots)} leaves owned (their update needs "
        f"whole tensors or layers) over {plan.layout.num_shards} devices: owned state "
        f"{min(nbytes):,}..{max(nbytes):,} bytes per device, update cost max/mean "
        f"{max(costs) / mean if mean else 1.0:.2f}"
    )


class ShardedTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`sharded` returns: an optax transformation whose ``init`` and
    ``update`` are the methods of a :class:`Sharded`, reachable as :attr:`optimizer`.
    It adds no fields and holds no attributes of its own."""

    __slots__ = ()

    @property
    def optimizer(self) -> Sharded:
        """The frozen :class:`Sharded` optimizer behind ``init`` and ``update``."""
        return self.init.__self__

    @property
    def inner(self) -> optax.GradientTransformationExtraArgs:
        return self.optimizer.inner

    @property
    def config(self) -> ShardConfig:
        return self.optimizer.config

    @property
    def axis_name(self) -> str:
        return self.config.axis_name

    def spanning(self, mesh: jax.sharding.Mesh) -> ShardedTransformation:
        """The drop-in's transformation on ``mesh`` (see :meth:`Sharded.spanning`)."""
        return self.over(self.optimizer.spanning(mesh).config.axes)

    def for_step(self, mesh: jax.sharding.Mesh) -> ShardedTransformation:
        """Zeroshard's step's transformation on ``mesh`` (see :meth:`Sharded.for_step`)."""
        return self.over(self.optimizer.for_step(mesh).config.axes)

    def over(self, axes: tuple[str, ...]) -> ShardedTransformation:
        """This transformation with its state split over ``axes`` (see
        :meth:`Sharded.over`); e.g. ``tx.over(opt_state.layout.axes)``."""
        return self._as(self.optimizer.over(axes))

    def at_stage(self, stage: int) -> ShardedTransformation:
        """This transformation at ZeRO ``stage`` (see :meth:`Sharded.at_stage`)."""
        return self._as(self.optimizer.at_stage(stage))

    def _as(self, opt: Sharded) -> ShardedTransformation:
        return self if opt is self.optimizer else ShardedTransformation(opt.init, opt.update)

    def apply_gradients(
        self, grads: PyTree, opt_state: ShardedState, params: PyTree, **extra_args: Any
    ) -> tuple[PyTree, ShardedState]:
        """``params, opt_state = tx.apply_gradients(grads, opt_state, params)``:
        ``tx.update`` and ``optax.apply_updates`` in one, the new weights themselves
        (those two give them up to the rounding of ``params + (new - params)``) and
        the new state. ``optax.apply_updates`` reads the old weights at the end of
        the step, so they stay alive through its backward pass; here they are not
        read after their last use. Takes what ``tx.update`` takes, wherever it does."""
        new, opt_state, (_, like) = self.optimizer.stepped(grads, opt_state, params, extra_args)
        return like(new), opt_state

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        has_aux: bool = False,
        *,
        accum_steps: int = 1,
        layout: LayoutKey | None = None,
    ) -> Callable[..., tuple]:
        """zeroshard's gradient in your own ``jax.jit``: ``fun``'s value and the mean
        gradient over the batch axes, each gradient reduced by zeroshard as the
        backward pass makes it (reduce-scattered; int8 with ``quantize_grads``, in a
        fixed order with ``deterministic=``, averaged over a replica axis;
        accumulated over ``accum_steps`` micro-batches), for ``tx.update``.

        ``fun(params, batch)`` (``fun(params, batch, key=key)`` when a key is given)
        returns a scalar loss, or ``(loss, aux)`` with ``has_aux``, as in
        :func:`zeroshard.make_train_step`. The returned function,
        ``f(params, batch, key=None, **kwargs)``, runs ``fun`` on each device's rows of
        ``batch`` (split over the batch axes) and returns ``(loss, grads)`` (with
        ``has_aux``: ``((loss, aux), grads)``): the global mean loss (aux as the step's
        metrics give it) and :class:`zeroshard.core.update.Grads`, each device's
        part of the mean gradient, which ``tx.update(grads, opt_state, params)`` takes
        with no further gradient collective::

            @jax.jit
            def step(params, opt_state, batch):
                loss, grads = tx.value_and_grad(loss_fn)(params, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

        On a mesh with Auto axes besides the batch's, a traced weight in your
        ``jax.jit`` shows no layout: pass the state's, ``layout=opt_state.layout``
        (static), so that a tensor-parallel weight's gradient is cut within its block
        as the state was made for; ``tx.update`` refuses parts cut otherwise.

        ``kwargs`` reach ``fun`` as keyword arguments, the same on every device: pass
        there the values of your step the loss reads (jax's ``shard_map`` refuses a
        traced value closed over by the loss on a mesh with Explicit axes). With
        ``loss_scale=``, multiply the loss by the scale yourself, as with ``jax.grad``
        (the loss returned is then the scaled one): ``f(params, batch,
        scale=opt_state.loss_scale.scale)`` for ``fun(params, batch, scale)``;
        ``tx.update`` divides the gradient by it and adjusts it, as the own step does.

        A loss whose own sharding calls cannot run per device (they name the batch
        axis, pass a ``PartitionSpec`` to ``reshard``, or leave it with ``auto_axes``)
        is differentiated on the whole mesh instead, as :func:`zeroshard.make_train_step`
        does: ``grads`` is then ``jax.grad``'s mean gradient, which ``tx.update`` takes
        as it takes yours (without the options only zeroshard's reduction has).

        Raises:
          ValueError: for a batch the batch axes do not divide; for such a loss with
            ``accum_steps``, ``deterministic=``, ``quantize_grads`` or a replica axis,
            jax's error with a note naming the option.
        """
        return gradient.value_and_grad(self.optimizer, fun, has_aux, accum_steps, layout)

    def shard_params(self, params: PyTree) -> PyTree:
        """``params`` laid out as ``stage=3`` keeps them in your own ``jax.jit``: each
        leaf cut over the mesh's batch axes along its first dimension after its
        stacked layer axes, within its own tensor-parallel block
        (:mod:`zeroshard.communication.jit_pieces`). Eagerly placed; inside a
        traced function, constrained. Call it once on the parameters you start from."""
        return shard_params(self.optimizer, params)

    def plan(
        self, params: PyTree, num_shards: int, splits: Mapping[int, Split] | None = None
    ) -> Plan:
        """See :meth:`Sharded.plan`."""
        return self.optimizer.plan(params, num_shards, splits)

    def state_specs(
        self, params: PyTree, num_shards: int, splits: Mapping[int, Split] | None = None
    ) -> ShardedState:
        """``PartitionSpec`` of every leaf of the global state, for ``jax.shard_map``."""
        return self.optimizer.specs_of(self.plan(params, num_shards, splits))


def check_made(
    layout: Layout, made: LayoutKey, axes: tuple[str, ...], splits: Mapping[int, Split]
) -> None:
    """Refuses a state of ``layout``'s leaves laid out as ``made`` says (the layout it
    carries) where one split over ``axes``, its leaves of ``splits`` kept block by
    block, is asked for: split over other axes, or a leaf kept in other blocks (a
    state made for the weights laid out otherwise than they are now).

    Raises:
      ValueError: naming the axes, or the first such leaf, and how to make the state
        again.
    """
    held, axes = made.by_leaf, tuple(axes)
    other = [i for i in sorted(held.keys() | splits.keys()) if held.get(i) != splits.get(i)]
    if made.axes != axes or other:
        i = other[0] if other else 0
        how = (
            f"it is split over the mesh axes {made.axes}, and here over {axes}"
            if made.axes != axes
            else f"it keeps {layout.slots[i].path} in {held.get(i, WHOLE).blocks} block(s) "
            f"over the mesh's other axes, and this layout in {splits.get(i, WHOLE).blocks}"
        )
        raise ValueError(
            "zs.sharded: the optimizer state was made for another mesh, or for the weights "
            f"laid out otherwise than they are now: {how}. Make the state from the weights "
            "as they are laid out (tx.init(params), zs.init_train_state, or "
            "zs.from_optax_state(..., param_specs=)), or lay them out as before."
        )


def optimizer_of(tx: Any) -> Sharded:
    """The :class:`Sharded` behind a transformation from :func:`sharded`.

    Raises:
      TypeError: if ``tx`` is not from :func:`sharded`, with the fix.
    """
    if not isinstance(tx, ShardedTransformation):
        raise TypeError(
            f"expected the optimizer returned by zs.sharded(...), got {type(tx).__name__}: "
            "wrap it, e.g. zs.sharded(optax.adamw(3e-4), axis_name='data')."
        )
    return tx.optimizer


def sharded(inner: optax.GradientTransformation, **options: Any) -> ShardedTransformation:
    """Wraps an optax optimizer so its state lives 1/N per device (ZeRO-1).

    ``update(grads, state, params)`` runs ``inner`` on this device's part only and
    all-gathers the new weights in the parameters' dtype. Inside ``jax.shard_map`` over
    ``axis_name`` it takes each device's *local, unreduced* gradients and
    reduce-scatters (averages) them (one collective per large leaf, small ones packed;
    see ``pack_bytes``). Anywhere else (the user's own ``jax.jit`` or ``nnx.jit`` step,
    ``nnx.Optimizer``, a Linen ``TrainState``) it takes the mean gradient that
    ``jax.grad`` returns there, and each device cuts its part out: the one-line
    drop-in for ``inner`` (see ``mesh``). Where the weights are typed ``reduced`` over
    the batch axes (Explicit axes: ``P(None, "model", reduced={"data"})``), ``jax.grad``
    returns the gradient's partial sums (``unreduced``), and it reduce-scatters them
    (weights typed whole beside them, a bias, say: their gradients as they come).

    Each leaf is placed where ``inner`` computes on it exactly. Where its update is
    elementwise (sgd, adam, lion, ...) or mixes elements only through sums (the
    per-tensor norms of lamb, lars, novograd, fromage; adafactor's update clipping),
    the leaf is *sliced*: every device updates 1/N of it, the sums summed across
    devices. Where the update needs more (factored moments as in adafactor; matrix
    functions as in muon), the leaf is *owned*: one device updates all of it and
    keeps its state; a ``stacked`` leaf updated layer by layer is owned layer by
    layer. Owned units are balanced by bytes or, for matrix work, by
    ``m * n * min(m, n)``. A 2-D leaf whose whole-tensor update would cost its owner
    more than its share, and which reduces along one axis only (the factored
    moments' row and column sums, Newton-Schulz's Gram matrix), is *blocked*: every
    device updates its block of rows or columns, with a ``psum`` of each reduction
    across the blocks (:mod:`zeroshard.core.blocks`). The choice is read from the traced
    update, per leaf (see :mod:`zeroshard.core.placement`).
    The returned updates are full-shape, so ``optax.apply_updates(params, updates)``
    gives the gathered weights (exactly whenever each new weight lies within a factor
    two of the old one, by Sterbenz's lemma; otherwise within one rounding of them).

    ``init(params)`` returns this device's slices inside ``shard_map``, else global
    arrays sharded over ``axis_name`` of the mesh (``mesh``, ``jax.set_mesh``, or the
    params' own); it works on ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``).
    Where the parameters carry Flax's sharding metadata (``nn.with_logical_partitioning``,
    ``nnx.with_partitioning``), each leaf of the state carries its own layout so, and
    ``nn.get_partition_spec`` / ``nnx.get_partition_spec`` of it keep that layout under
    any logical axis rules.

    In a profile, and in the compiled program's op names, ``update`` shows as named
    scopes (:mod:`zeroshard.measuring.scopes`): ``zeroshard/reduce_scatter`` (or
    ``zeroshard/cut``, where it takes the mean gradient), ``zeroshard/grad_norm``,
    ``zeroshard/update`` (the inner optimizer), ``zeroshard/all_gather``. The
    skipped-step count and the loss scale are on the state (``state.skipped``,
    ``state.loss_scale``); :func:`zeroshard.make_train_step` reports them per step.

    The options are keywords, declared (with their defaults) and validated once by
    :class:`zeroshard.ShardConfig`.

    Args:
      inner: any optax transformation whose update treats leaves separately, or
        combines them through sums (``optax.clip_by_global_norm``'s global norm is
        summed across devices where it is used). Combining leaves otherwise
        (``optax.apply_if_finite``) is refused with a ``ValueError``.
      **options: the keywords below.
      axis_name: the mesh axis the batch (and the state) is split over, or a tuple of
        axes (``("data", "fsdp")``): split over all of them. zeroshard's step
        splits the state over the mesh's other axes too (a tensor-parallel
        ``"model"``, say: :meth:`Sharded.for_step`); where
        ``update`` takes the mean gradient (the one-line drop-in), the state is split
        over every axis of the mesh but ``replica_axis``, and ``axis_name`` need not
        name one of them (:meth:`Sharded.spanning`).
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
        ``state.skipped`` counts the step (a train step reports it as
        ``metrics["skipped"]``). The decision rides on the gradient-norm all-reduce,
        so all devices agree. ``False`` applies every update.
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
        every layer of a sliced leaf, and in stage 3 ``jax.lax.scan`` over the
        stacked pieces gathers one layer per iteration (:func:`zeroshard.layer`); a
        leaf with one layer axis whose update needs whole tensors but treats each
        layer separately is owned layer by layer. Numbers are the same either way;
        ``None`` (default) marks nothing.
      placement: forces leaves ``"sliced"`` or ``"owned"``: a tree like the
        parameters, or a function ``(path, leaf) -> "sliced" | "owned" | None``
        (``None``: automatic). Forcing a leaf sliced whose update needs the whole
        tensor is refused. A stacked leaf forced owned is owned whole unless its
        update needs whole layers, and treats them separately. A leaf forced owned
        is never blocked.
      mesh: the mesh the state lives on when ``init`` and ``update`` run outside
        ``shard_map``: in the user's own ``jax.jit`` (or ``nnx.jit``) step, where
        ``update`` takes the mean gradient that ``jax.grad`` returns there. ``None``:
        the mesh set with ``jax.set_mesh``, else that of the state's arrays. Under
        ``jax.set_mesh`` of another mesh, ``init`` and ``update`` raise a
        ``ValueError`` naming both.
      group_alike: on more than one device, update the sliced leaves smaller than
        ``pack_bytes`` whose update is the same elementwise computation (the same
        optimizer and hyperparameters, mask and label, on pieces of one shape and
        dtype) as one buffer: their
        pieces lie end to end in the state, and the compiled step has one update per
        group instead of one per leaf (a model of many layers traces and compiles
        faster). Every element is computed as before, the same bits; only a sum over
        several leaves (``optax.clip_by_global_norm``'s norm) is taken in another
        order. ``False`` keeps one piece per leaf. Checkpoints are per leaf either way.
      quantize_grads: ``"int8"`` or ``"int4"`` to reduce the gradients as blockwise
        integer codes (one float32 scale per block) instead of in their dtype
        (:mod:`zeroshard.communication.quantized`): each device quantizes its local gradient once,
        one ``all_to_all`` brings every device's codes of its piece, and it decodes
        and sums them in float32 (the replica axis, if any, in a second level). The
        reduction's bytes shrink about 4x (int8) or 8x (int4) from float32, 2x or
        4x from bfloat16, for a rounding error of up to half a step
        (``max |x| / 254`` or ``/ 14`` per block) in each device's gradient. For
        links slower than the step's compute (across hosts). In stage 3 the
        reduction is the transpose of each layer's gather. Where ``update`` takes
        the mean gradient (the user's own ``jax.jit``), ``jax.grad`` reduced it
        already and nothing is quantized (a warning says so; at ``stage`` 2 and 3 it
        is refused). ``None``: exact.
      quantize_weights: ``"int8"`` to send the new weights as blockwise int8 codes:
        the all-gather after the update (stages 1 and 2, and the one-line drop-in
        at ``stage`` 1 and 2) or every stage-3 gather, forward and backward. All
        devices, the owner too, compute with the same decoded weights; the exact
        weights stay in the optimizer state, whose master weights every leaf then
        keeps (``4 / N`` bytes per float32 parameter more, where none was needed).
        ``None``: exact.
      quantize_block: the most elements per quantization block. Blocks never span
        two leaves; a leaf's piece of ``w`` elements is cut in ``ceil(w / block)``
        equal blocks. The scales cost ``4 / block`` bytes per element (1.6% of the
        int8 codes at 256).
      deterministic: ``None``, or a power of two ``M``: the same global batch gives
        the same bits on every device count that divides ``M``
        (:func:`zeroshard.make_train_step` only; see :mod:`zeroshard.communication.canonical`). The
        step cuts the global batch into ``M`` micro-batches whose gradients are summed
        in one fixed binary tree, and every sum over a leaf's elements in the update
        (global norms, trust ratios, RMS) runs over ``M`` fixed chunks of the leaf.
        A checkpoint saved on 8 devices and resumed on 4 continues bit for bit.
      state_bits: ``8`` or ``4`` to store the inner optimizer's floating per-element
        state of matrices (Adam's ``mu`` and ``nu``) in that many bits between steps,
        with a float32 scale per block of 256 (8 bits) or 128 elements (4 bits):
        about 0.27x or 0.16x of its float32 bytes. Decoded to float32 for the update
        and coded again after it, in the same step, a bounded piece at a time where
        the update is elementwise (:mod:`zeroshard.core.piecewise`); blocks follow the
        leaf's global index, so the codes are the same on any device count and
        stage. Vectors,
        scalars, matrices with fewer elements per layer than a block, and owned or
        blocked leaves keep their state exact; the master weights stay float32
        (:mod:`zeroshard.core.lowbit`). ``None``: as the inner optimizer keeps it.
      stage: the ZeRO stage of ``update`` in your own ``jax.jit`` (zeroshard's step
        takes its own ``stage=``): ``1`` (default); ``2``, the gradients reduced to
        1/N pieces layer by layer in the backward pass; ``3``, the weights kept as
        global arrays cut 1/N too (lay them out once with
        ``tx.shard_params(params)``). Both with ``zs.layer`` around the scan body of
        each layer stack (:mod:`zeroshard.communication.jit_pieces`, which says what they refuse).

    Returns:
      A :class:`ShardedTransformation`: an ``optax.GradientTransformationExtraArgs``
      whose ``init`` and ``update`` belong to a frozen :class:`Sharded` built from
      ``inner`` and a :class:`zeroshard.ShardConfig` of the options above (validated
      here; nothing is set on the transformation afterwards).

    Raises:
      ValueError: for inconsistent options (see :class:`zeroshard.ShardConfig`); at
        ``init`` when ``inner`` mixes leaves, the params are empty, ``axis_name``
        is not bound, or the update calls back into the model (``optax.lbfgs``'s
        ``value_fn=``); at ``update`` when the gradients do not match the params, or
        an extra argument is a function.
      TypeError: for an ``inner`` that is not an optax transformation, an unknown
        option, an axis name that is not a string; when a parameter leaf is not
        floating point.

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
    if unknown := sorted(options.keys() - {f.name for f in dataclasses.fields(ShardConfig)}):
        raise TypeError(f"zs.sharded got unknown options {unknown}; see help(zs.sharded).")
    config = ShardConfig(**options)
    opt = Sharded(optax.with_extra_args_support(inner), config)
    return ShardedTransformation(opt.init, opt.update)
