"""Update: the one update flow, shared by every entry point.

Inside ``shard_map`` over the sharding axis, one step of the sharded optimizer is:

1. the gradients *arrive* as this device's part of the mean gradient, by the
   :class:`zeroshard.communication.arrival.Arrival` the entry point chose (reduce-scattered local
   gradients, stage-3 pieces sent to their owners (stage 2 through a loss that
   gathers too: :mod:`zeroshard.training.held`), or the mean gradient cut);
2. :func:`updated` (the new parameters and state) averages that part over the
   replica axis (if the arrival has not), casts it to the inner dtypes, skips the step
   everywhere if it is not finite, and runs the inner optimizer on this device's part
   (a 1/N piece of every sliced leaf and the whole of each leaf it owns), with the
   moments and master weights kept here;
3. the parameters *leave* by the :class:`zeroshard.communication.departure.Departure` chosen with
   the arrival: all-gathered whole, or as :class:`zeroshard.Piece` pieces again.

``tx.update`` in a user's ``shard_map`` or ``jax.jit``, :func:`zeroshard.make_train_step`
(stages 1-3, with and without accumulation) and the Flax steps all call :func:`updated`;
they differ only in the arrival and departure they give it.

Each part runs in a named scope (:mod:`zeroshard.measuring.scopes`): the arrival's
(``zeroshard/reduce_scatter``, ``zeroshard/cut`` or ``zeroshard/to_owners``),
``zeroshard/replica_mean``, ``zeroshard/grad_norm``, ``zeroshard/update``, the
departure's (``zeroshard/all_gather`` or ``zeroshard/from_owners``), so a profile and
the compiled program's op names tell them apart.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeroshard.analysis import check_extra_args
from zeroshard.communication import canonical
from zeroshard.communication.arrival import (
    Arrival,
    CutMean,
    GradParts,
    MeanPieces,
    PartialSums,
    Pieces,
    ReduceScatter,
    part_specs,
)
from zeroshard.communication.codecs import Canonical, Exact, Quantized
from zeroshard.communication.departure import Departure, departure_of
from zeroshard.core import branches, piecewise
from zeroshard.core.blocks import to_pieces
from zeroshard.core.layout import PyTree
from zeroshard.core.placement import Plan
from zeroshard.measuring.scopes import GRAD_NORM, UPDATE, scope
from zeroshard.optimizer.config import ShardConfig
from zeroshard.optimizer.state import ShardedState
from zeroshard.training.microbatches import Accumulated, InOrder, OneBatch

logger = logging.getLogger(__name__)


class Route(NamedTuple):
    """How a step moves its gradients and weights, chosen once (:meth:`of`), where a
    step or ``tx.update`` is built, and given to :func:`updated`.

    Attributes:
      arrival: how the gradients arrive (:mod:`zeroshard.communication.arrival`).
      departure: how the new weights leave (:mod:`zeroshard.communication.departure`).
      loop: how the step's micro-batches give the loss and gradient parts
        (:mod:`zeroshard.training.microbatches`).
      gather: stage 3's gather of a dtype's pieces, ``gather(pieces, axis_name,
        dtype)`` (every device's piece of each, row ``d`` from device ``d``), whose
        transpose reduces the gradients; what :func:`zeroshard.gather` runs in the step.
      held: stage 2's route through a loss that gathers (:mod:`zeroshard.training.held`):
        stage-3 pieces in, all-gathered weights out (a held gather sends none);
        ``None`` at other stages, and where the fixed-order sums of ``deterministic=``
        keep the plain stage-2 step.
    """

    arrival: Arrival
    departure: Departure
    loop: OneBatch
    gather: Callable[..., list]
    held: Route | None = None

    @classmethod
    def of(
        cls,
        config: ShardConfig,
        stage: int | None = None,
        mean: bool = False,
        accum_steps: int = 1,
        summed: frozenset[str] = frozenset(),
        batch_axes: tuple[str, ...] | None = None,
    ) -> Route:
        """The route of a step inside ``shard_map`` for a ZeRO ``stage`` (default: the
        config's, :meth:`zeroshard.optimizer.sharded.Sharded.at_stage`): reduce-scattered
        local gradients and all-gathered weights (stages 1 and 2), or stage-3 pieces
        both ways; with ``mean``, the mean gradient cut (``tx.update`` in a user's
        ``jax.jit``; at stages 2 and 3 there, its pieces as they arrive; its partial
        sums over the mesh axes ``summed``, reduce-scattered, where they arrive so); at
        stage 2, :attr:`held` too. Each quantized, or summed in a fixed
        order, where ``config`` says so; the micro-batches as ``accum_steps`` and the
        order of sums say, over ``batch_axes`` (default: the config's; a step's state
        may span more axes than its batch).

        Raises:
          ValueError: if ``accum_steps`` comes with ``deterministic=``, which cuts the
            batch itself.
        """
        grads, parts = config.grad_quantizer, config.deterministic
        axes = batch_axes or config.batch_axes
        stage = config.stage if stage is None else stage
        axes = axes if len(axes) > 1 else axes[0]
        # (from stage 2, each micro-batch's gradient arrives on its own)
        loop = OneBatch(axes) if accum_steps == 1 else Accumulated(axes, accum_steps, stage > 1)
        if parts is not None:  # stage 1 sums each device's micro-batches first (LOW)
            loop = InOrder(axes, each=stage > 1, parts=parts, accum_steps=accum_steps)
            codec = Canonical(canonical.LOW if stage == 1 else canonical.HIGH)
        else:
            codec = Quantized() if grads else Exact()
        gather = codec.gather(config)  # (stage 3's weights are quantized in its gathers)
        # (with mean, tx.update at stages 2-3 in a jax.jit: the mean gradient's pieces)
        pieces = MeanPieces(config) if mean else Pieces(config, codec)
        if stage == 3:
            return cls(pieces, departure_of(config, pieces=True), loop, gather)
        all_gathered = departure_of(config, pieces=False)
        held = stage == 2 and config.sum_order.any_order
        held = cls(pieces, all_gathered, loop, gather) if held else None
        if mean and grads is not None:
            logger.warning(
                "zs.sharded(quantize_grads=%r): tx.update here takes the mean gradient, which "
                "jax.grad in your jit reduced already, so no gradient is quantized; "
                "zs.make_train_step (or tx.update inside jax.shard_map) reduces them quantized.",
                config.quantize_grads,
            )
        if mean:
            arrival = PartialSums(config, summed=summed) if summed else CutMean(config)
        else:
            arrival = ReduceScatter(config, codec)
        return cls(arrival, all_gathered, loop, gather, held)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Grads:
    """The mean gradient as ``tx.value_and_grad`` returns it
    (:mod:`zeroshard.training.gradient`): each device's parts of it
    (:data:`zeroshard.communication.codecs.GradParts`), global arrays whose blocks are
    the devices' parts, and how they came. ``tx.update(grads, opt_state, params)``
    takes them with no further gradient collective.

    Attributes:
      parts: the parts: a 1-D array per sliced leaf (``None`` for a leaf one device
        owns), and per bucket of owned leaves the owners' rows.
      route: how they came (static).
      axes: the mesh axes their blocks are split over, major first (static).
      splits: the leaves they keep block by block, and how (static).
    """

    parts: GradParts
    route: Route = dataclasses.field(metadata=dict(static=True))
    axes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    splits: tuple = dataclasses.field(metadata=dict(static=True))

    @staticmethod
    def splits_of(plan: Plan) -> tuple:
        """``plan``'s leaves kept block by block, as :attr:`splits` records them."""
        return tuple(sorted(plan.layout.splits.items(), key=lambda item: item[0]))

    def specs(self, plan: Plan) -> tuple[list, tuple]:
        """The parts' ``PartitionSpec``s for ``plan``, the update's.

        Raises:
          ValueError: where ``plan`` keeps other leaves block by block than the parts.
        """
        if self.splits_of(plan) != self.splits:
            raise ValueError(
                "tx.update got tx.value_and_grad's gradient for the weights laid out "
                "otherwise than the optimizer state was made for (in a jax.jit on Auto "
                "mesh axes a traced weight shows no layout): pass the state's, "
                "tx.value_and_grad(loss_fn, layout=opt_state.layout)."
            )
        return part_specs(plan, self.axes)


def updated(
    inner: optax.GradientTransformationExtraArgs,
    config: ShardConfig,
    plan: Plan,
    route: Route,
    parts: GradParts,
    state: ShardedState,
    params: PyTree,
    **extra_args: Any,
) -> tuple[PyTree, ShardedState]:
    """The sharded update of this device's part: returns the new parameters, laid out
    as ``params`` (whole, or stage-3 :class:`zeroshard.Piece` pieces), and state.

    Args:
      inner: the inner optimizer.
      config: the sharded optimizer's options.
      plan: its plan for the parameters.
      route: how ``parts`` arrived (:mod:`zeroshard.communication.arrival`), and how the
        parameters are held and leave (:mod:`zeroshard.communication.departure`).
      parts: this device's part of the mean gradient over the sharding axis
        (``route.arrival.bring(plan, grads)``, or its sum over micro-batches).
      state: this device's :class:`zeroshard.ShardedState`.
      params: the current parameters, in the form ``route.departure`` holds them.
      **extra_args: passed on to the inner ``update``.

    Raises:
      TypeError: if ``extra_args`` lacks one the inner update requires.
    """
    check_extra_args(extra_args, plan.analysis.extras)
    arrival, departure = route.arrival, route.departure
    grad_pieces, grad_rows = arrival.across_replicas(parts)
    # The owned leaves' current weights, as the departure reads them, used where no
    # separate master is kept.
    weights = departure.owned_weights(plan, params)
    with scope(UPDATE):  # this device's part in the dtypes the inner optimizer works in
        # Grouped first (a packed row's slices, laid out together: no copy), then cast
        # once per group (and unscaled: the gradients are of the scaled loss).
        arrived, dtypes = plan.on_view.grouped(grad_pieces), plan.inner_dtypes
        by = None if config.loss_scale is None else state.loss_scale.scale
        prepare = lambda i, g: _inner(g, dtypes[plan.layout.slots[i].bucket], by)
        grad_pieces = [
            None if s.owned else prepare(i, g)
            for i, (s, g) in enumerate(zip(plan.layout.slots, arrived, strict=True))
        ]
        grad_rows = plan.layout.per_owned_bucket(lambda b, _: _inner(grad_rows[b], dtypes[b], by))
        pieces = master_pieces(plan, state, departure.own_pieces(plan, params))
    # The norm leaf by leaf, as without groups (the same sum, the same bits).
    with scope(GRAD_NORM):
        grad_norm, finite = arrival.norm_and_finite(plan, grad_pieces, grad_rows)
    with scope(UPDATE):
        update_branch = _branch_update(inner, config, plan, route, extra_args, prepare)
        # (a leaf updated a piece at a time prepares its gradient a piece at a time: no
        # float32 copy of the whole piece, zeroshard.core.piecewise)
        later = piecewise.pieced(plan)
        grad_pieces = [arrived[i] if i in later else g for i, g in enumerate(grad_pieces)]
        args = (grad_pieces, grad_rows, pieces, weights, state, finite)
        new, rows, inner_state, owned = branches.run_branches(
            plan, config.axis_name, update_branch, *args
        )
        inner_state = branches.replicated_again(plan, config.axis_name, inner_state)
        skipped = state.skipped
        if config.skip_nonfinite:
            skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
        master = None if state.master is None else plan.master_tree(new)
        loss_scale = config.loss_scale
        scale = None if loss_scale is None else loss_scale.adjust(state.loss_scale, finite)
    new_state = ShardedState(inner_state, master, grad_norm, skipped, scale, owned, state.layout)
    # Cast to the parameters' dtypes once per group; the departure cuts the leaves out.
    cast = lambda s, x: None if x is None else x.astype(s.dtype)
    return departure.send(plan, plan.layout.sliced(cast, new), rows, params), new_state


def region(
    opt: Any,
    plan: Plan,
    route: Route,
    mesh: Any,
    specs: tuple,
    arrive: Callable[[Any, PyTree], tuple[Any, PyTree]] | None = None,
    leave: Callable[[PyTree, PyTree], PyTree] | None = None,
    check_vma: bool = True,
) -> Callable[..., tuple[PyTree, ShardedState]]:
    """The one update region every entry point runs: ``jax.shard_map`` manual over
    every axis of ``mesh``, ``(grads, state, params, extra_args) -> (new params,
    state)``: the gradients' parts (``arrive(grads, params)`` gives them and the
    weights as the departure holds them; default: ``grads`` are the parts, ``params``
    those weights), :func:`updated`, and the new weights (``leave(new, params)``;
    default: as :func:`updated` returns them).

    Args:
      opt: the sharded optimizer (:class:`zeroshard.optimizer.sharded.Sharded`).
      plan: its plan for the parameters.
      route: how the parts arrive and the weights leave.
      mesh: the mesh (concrete or abstract).
      specs: ``PartitionSpec`` trees of the gradients, the state, the weights in, and
        the new weights out.
      arrive: the gradients' parts on this device, and the weights ``updated`` takes.
      leave: the new weights as the region returns them.
      check_vma: ``shard_map``'s type check (off on one device: nothing is reduced).
    """
    grads, state, params, out = specs

    def local(grads: Any, state: ShardedState, params: PyTree, extra_args: dict) -> tuple:
        parts, held = arrive(grads, params) if arrive else (grads, params)
        new, state = updated(opt.inner, opt.config, plan, route, parts, state, held, **extra_args)
        return (leave(new, params) if leave else new), state

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(grads, state, params, P()),
        out_specs=(out, state),
        axis_names=set(mesh.axis_names),
        check_vma=check_vma,
    )


def handed(plan: Plan, parts: GradParts) -> GradParts:
    """``parts`` as a step's loss region hands them to its update region
    (:func:`region`): in the dtypes the inner optimizer takes them, as :func:`updated`
    casts them (but a leaf updated a piece at a time, :mod:`zeroshard.core.piecewise`,
    as it arrived). Cast in the loss region, a low-precision sum XLA computed in
    float32 stays unrounded, as it did when the update ran in that region."""
    dtypes, slots, later = plan.inner_dtypes, plan.layout.slots, piecewise.pieced(plan)
    cast = lambda g, d: None if g is None else g.astype(d)
    pieces = [
        g if i in later else cast(g, dtypes[s.bucket])
        for i, (s, g) in enumerate(zip(slots, parts[0], strict=True))
    ]
    return pieces, tuple(cast(r, dtypes[b]) for b, r in enumerate(parts[1]))


def master_pieces(
    plan: Plan, state: ShardedState, own: list[jax.Array | None]
) -> list[jax.Array | None]:
    """This device's pieces of the sliced leaves' master weights, grouped
    (:meth:`zeroshard.core.placement.Grouping.grouped`; 1-D, inner dtypes; ``None`` for owned
    and hidden leaves).

    Args:
      plan: the plan for the parameters.
      state: this device's :class:`zeroshard.ShardedState`.
      own: this device's pieces of the parameters themselves (used where no separate
        master is kept).
    """
    layout, dtypes = plan.layout, plan.inner_dtypes
    master = (
        [None] * len(own) if state.master is None else layout.treedef.flatten_up_to(state.master)
    )
    pick = lambda s, p, m: (
        m.reshape(-1) if m is not None else None if p is None else p.astype(dtypes[s.bucket])
    )
    return layout.sliced(pick, plan.on_view.grouped(own), master)


def _inner(g: jax.Array | None, dtype: Any, scale: jax.Array | None) -> jax.Array | None:
    """Gradient ``g`` in the inner optimizer's ``dtype``, divided by the loss ``scale``
    (``None``: none)."""
    if g is None:
        return None
    g = g.astype(dtype)
    return g if scale is None else (g / scale).astype(g.dtype)


def _branch_update(
    inner: Any, config: ShardConfig, plan: Plan, route: Route, extra_args: dict, prepare: Any
) -> Any:
    """The update of one branch (see :mod:`zeroshard.core.branches`): its view of the
    gradients and weights, the inner update (in a conditional on ``finite`` when
    non-finite steps are skipped), and its new pieces, owned rows and state.
    ``prepare(i, g)``: leaf ``i``'s gradient piece ``g`` as the inner optimizer takes
    it, for those the view holds as they arrived (:func:`zeroshard.core.piecewise.pieced`)."""
    axis, layout = config.axis_name, plan.layout
    arrival, departure = route.arrival, route.departure

    def update_branch(b, grad_pieces, grad_rows, pieces, weights, state, finite):
        stored, device = plan.storage.unpack(state.owned, b), plan.branch_of.index(b)
        g = plan.in_branch(b, lambda i, s, _: arrival.owned(layout, grad_rows[s.bucket], i, device))
        local = departure.local(plan, b, weights, device)
        zeros = lambda i: jnp.zeros_like(g[i], plan.inner_dtypes[layout.slots[i].bucket])
        p = plan.in_branch(  # weights the update does not read, in stage 3: zeros (see unread)
            b, lambda i, s, _: stored.get(("master", i), zeros(i) if local[i] is None else local[i])
        )
        inner_state = branches.stored_state(plan, state.inner_state, stored)
        # The new weights vary over the axis: so must the old ones (whole leaves come
        # from the replicated params) for the conditional below.
        params = branches.varying(plan.view(b, pieces, p, axis), axis)
        grads = plan.view(b, grad_pieces, g, axis)

        def apply(grads, state, params):
            updates, new_state = plan.updates_and_state(
                inner, grads, state, params, axis, **extra_args
            )
            new = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
            return new, branches.varying_like(new_state, state, axis)

        def step(inner_state, params, grads, finite=None):
            # The hidden leaves are absent (None) from the conditional's operands: an
            # operand costs XLA's partitioner even when empty. Where the inner
            # optimizer needs them present, their zero-element pieces are made here.
            full, state = plan.on_view.filled(params), plan.on_state.filled(inner_state)
            # (coded state decoded, updated and coded again, a piece at a time)
            grads = plan.on_view.filled(grads)
            new, new_state = piecewise.updated(plan, apply, grads, state, full, prepare, finite)
            new_state = plan.on_state.compact(new_state)
            return plan.on_view.compact(new), branches.varying_like(new_state, inner_state, axis)

        if config.skip_nonfinite and not piecewise.pieced(plan):
            # One conditional, not a select per element: the update runs in place, with
            # no copy of the old state kept alive until the verdict.
            unchanged = lambda inner_state, params, _: (params, inner_state)
            new, new_state = jax.lax.cond(finite, step, unchanged, inner_state, params, grads)
        else:  # (with leaves updated a piece at a time, zeroshard.core.piecewise skips)
            verdict = finite if config.skip_nonfinite else None
            new, new_state = step(inner_state, params, grads, verdict)
        new = to_pieces(layout.slots, layout.treedef.flatten_up_to(new), axis)
        rows = layout.per_owned_bucket(
            lambda k, _: departure.row(layout, new, device, k, plan.inner_dtypes[k])
        )
        kept, owned_rows = branches.kept_and_stored(plan, b, new_state, new)
        ravel = lambda s, x: None if x is None else jnp.ravel(x)
        return layout.sliced(ravel, new), rows, kept, owned_rows

    return update_branch
