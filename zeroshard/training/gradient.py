"""Gradient: zeroshard's gradient, the first of a step's two regions, and ``tx.value_and_grad``.

The loss region runs the loss on each device's rows, manual over the batch axes (the
keys folded with the device's index, the loss scaled, the micro-batch loop, stage 2's
held route, stage 3's gathers, the fixed-order rounds), and reduces each gradient as
its route's arrival says (:mod:`zeroshard.communication.arrival`). Its parts of the
mean gradient leave the region as global arrays, each device's block its own part
(:func:`zeroshard.communication.arrival.part_specs`), in the dtypes the update takes
them (:func:`zeroshard.core.update.handed`); the update region
(:func:`zeroshard.core.update.region`) takes them with no further gradient
collective. :class:`zeroshard.training.step.TrainStep` is the two regions;
``tx.value_and_grad`` (:func:`value_and_grad`) gives the first in a user's own
``jax.jit``, as :class:`zeroshard.core.update.Grads` that ``tx.update`` takes.

A loss whose own sharding calls cannot run per device (:class:`Refusals`) is
differentiated on the whole mesh instead (:func:`on_whole_mesh`), by both entries: the
own step's :mod:`zeroshard.training.whole_mesh` step and ``tx.value_and_grad``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.analysis.reads import reads_only_gathered
from zeroshard.communication.arrival import Nested, part_specs
from zeroshard.communication.jit_pieces import as_pieces
from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import StepContext, find_mesh, in_step, keep_axes
from zeroshard.core.placement import Plan
from zeroshard.core.update import Grads, Route, handed
from zeroshard.optimizer.config import kept_apart
from zeroshard.training import held, step_io

logger = logging.getLogger(__name__)

Key = jax.Array | None
"""A step's random key (``None``: none)."""


@dataclasses.dataclass(eq=False)
class LossRegion:
    """The loss region of a step on ``mesh``: ``loss_fn`` (in the convention of
    :func:`zeroshard.make_train_step`) differentiated on each device's rows, its
    gradients brought by ``route`` (over the state's other axes ``rest`` too, where
    there are any: :class:`zeroshard.communication.arrival.Nested`).

    Attributes:
      loss_fn: the user's loss.
      has_aux: whether it returns ``(loss, aux)``.
      config: the step's optimizer options (its batch axes, stage, reduce dtype).
      route: how the gradients arrive (and, from :attr:`taken`, leave).
      rest: the state's axes besides the batch's.
      mesh: the mesh.
      taken: the route the last trace took (stage 2's :attr:`Route.held` where the
        loss reads the weights only through ``zs.gather``), for the update region.
    """

    loss_fn: Callable[..., Any]
    has_aux: bool
    config: Any
    route: Route
    rest: tuple[str, ...]
    mesh: Any
    taken: Route | None = None

    def __post_init__(self) -> None:
        self.nested = Nested(self.route.arrival, self.rest) if self.rest else None
        # Stage 2 with a loss that gathers (its pieces are over the batch axes)
        self.held_route = None if self.nested else self.route.held
        self.batch_axes = self.route.loop.axes
        self.taken = self.route

    def __call__(
        self, plan: Plan, specs: PyTree, params: PyTree, batch: PyTree, key: Key, extras: tuple
    ) -> tuple:
        """The region on ``params`` (laid out as ``specs``, over the batch axes) and
        ``batch`` (split over them): this device's parts of the mean gradient as
        global arrays, the update's extra arguments, the loss metrics and the model
        state (``extras``: the model state and the loss scale's state, or ``None``, and
        the keyword arguments the loss takes besides, replicated)."""
        axes = self.config.batch_axes
        batch_specs = jax.tree.map(lambda _: P(self.batch_axes), batch)
        region = jax.shard_map(
            partial(self.local, plan=plan),
            mesh=self.mesh,
            in_specs=(specs, batch_specs, P(), P()),
            out_specs=(part_specs(plan, self.route.arrival.part_axes(axes)), P(), P(), P()),
            axis_names=set(axes),
            # On one device (of the state) nothing is reduced or gathered: without the types,
            # the gradients are not all-reduced for us and the collectives are left out.
            check_vma=plan.layout.num_shards > 1,
        )
        # zs.gather and zs.layer's default axis, and how they gather
        with in_step(StepContext(self.config.axis_name, self.route.gather, self.rest)):
            return region(params, batch, key, extras)

    def local(self, params: PyTree, batch: PyTree, key: Key, extras: tuple, plan: Plan) -> tuple:
        """The region on this device (see :meth:`__call__`)."""
        model_state, scale, kwargs = extras
        loss_fn = partial(self.loss_fn, **kwargs)
        value_and_grad = self._value_and_grad(loss_fn, scale)
        route, params = self.route, self._varying(params)
        if self._holds(loss_fn, params, batch, key, model_state):
            route, loss = self.held_route, step_io.step_loss(loss_fn, self.has_aux, scale)
            value_and_grad = held.value_and_grad(loss, params)
            params = held.pieces_of(
                plan.layout, params, self.config.axis_name, self.config.reduce_dtype
            )
        self.taken = route  # (read by the update region, traced after this one)
        loop, arrival = route.loop, self.nested or route.arrival
        out, parts = loop.run(value_and_grad, params, batch, key, model_state, plan, arrival)
        loss, (aux, model_state) = out
        if scale is not None:
            loss = loss / scale.scale
        # An update that requires value= (optax.contrib.reduce_on_plateau) gets the
        # step's global mean loss, as plain optax's update(..., value=loss) would.
        extra = {}
        if "value" in plan.analysis.extras:
            mean = loss.astype(jnp.float32)
            extra["value"] = mean if loop.reduced else step_io.pmean(mean, self.batch_axes)
        metrics = step_io.loss_metrics(loss, aux, batch, self.batch_axes, loop.reduced)
        if not loop.reduced:  # (averaged already)
            model_state = step_io.mean_state(model_state, self.batch_axes)
        return handed(plan, parts), extra, metrics, model_state

    def _holds(
        self, loss_fn: Callable, params: PyTree, batch: PyTree, key: Key, model_state: PyTree
    ) -> bool:
        """Whether this stage-2 step hands its loss
        :class:`zeroshard.communication.stage3.Held` leaves
        (:mod:`zeroshard.training.held`): its loss reads the parameters only through
        :func:`zeroshard.gather` (traced on one micro-batch of the device's rows)."""
        if self.held_route is None:
            return False
        rows = jax.tree.map(lambda x: x[: x.shape[0] // self.route.loop.steps], batch)
        loss = step_io.step_loss(loss_fn, self.has_aux, None)
        key = step_io.device_key(key, self.batch_axes)
        return reads_only_gathered(loss, params, rows, key, model_state)

    @property
    def part_axes(self) -> tuple[str, ...]:
        """The axes the parts of the route the last trace took vary over, for the
        update: the batch axes and :attr:`rest`, less those its arrival sums over
        (:meth:`zeroshard.communication.arrival.Arrival.part_axes`)."""
        return self.taken.arrival.part_axes((*self.config.batch_axes, *self.rest))

    def _value_and_grad(self, loss_fn: Callable, scale: Any) -> Callable[..., Any]:
        """The loss (times the loss scale, if any) and its gradient, in the step's
        convention (:func:`zeroshard.training.step_io.step_loss`)."""
        loss = step_io.step_loss(loss_fn, self.has_aux, scale)
        return jax.value_and_grad(loss, has_aux=True)

    def _varying(self, params: PyTree) -> PyTree:
        """``params`` cast to vary over the batch axes: the gradient of an invariant
        input would be all-reduced automatically (a local gradient is what the
        reduce-scatter needs). Stage-3 pieces vary over the sharding axis already, and
        over the replica axis, if any, as the parts do
        (:meth:`zeroshard.communication.arrival.Arrival.part_axes`)."""
        axes = self.config.batch_axes  # (the replica axis, if any, then the sharding axis)
        if self.route.departure.pieces:
            axes = self.route.arrival.part_axes(axes)
            axes = tuple(a for a in axes if a not in self.config.axes)
        return jax.lax.pcast(params, axes, to="varying") if axes else params


def value_and_grad(
    opt: Any,
    fun: Callable[..., Any],
    has_aux: bool = False,
    accum_steps: int = 1,
    layout: Any = None,
) -> Callable[..., tuple]:
    """``tx.value_and_grad`` (see
    :meth:`zeroshard.optimizer.sharded.ShardedTransformation.value_and_grad`) for the
    sharded optimizer ``opt``. A loss whose own sharding calls fail per device
    (:class:`Refusals`) is differentiated on the whole mesh instead
    (:func:`on_whole_mesh`): its gradient is ``jax.grad``'s, the mean gradient."""
    config = opt.config

    def run(params: PyTree, batch: PyTree, key: Key = None, **kwargs: Any) -> tuple:
        mesh = find_mesh(config, params, any_axes=True)
        step, plan = opt.spanned(mesh, params, layout)
        config.sum_order.check_devices(plan.layout.num_shards, step.config.axis_name)
        route = step.route_of(accum_steps=accum_steps, batch_axes=config.batch_axes)
        parts = math.prod(mesh.shape[a] for a in config.batch_axes)
        route.loop.check(parts)
        route.loop.check_batch(batch, parts)
        refusals = Refusals(fun)
        rest = tuple(a for a in step.config.axes if a not in config.batch_axes)  # (the state's)
        region = LossRegion(refusals.loss, has_aux, config, route, rest, mesh)
        batch = step_io.placed(batch, NamedSharding(mesh, P(config.batch_axes)))
        # (the weights whole over the batch axes; over the others as laid out)
        given, specs = params, P()
        if route.departure.pieces:  # (stage 3: the drop-in's blocks as pieces, no data moved)
            axis = step.config.axis_name
            params = as_pieces(params, plan.layout, mesh, axis)
            specs = keep_axes(route.departure.param_specs(plan.layout, axis), config.batch_axes)
        try:
            parts, _, metrics, _ = region(plan, specs, params, batch, key, (None, None, kwargs))
        except REFUSED as error:  # (raised while tracing)
            if "Closing over inputs to shard_map" in str(error):
                error.add_note(CLOSURE)
            if error is not refusals.error:
                raise
            check_whole_mesh(opt, mesh, accum_steps, error, "tx.value_and_grad")
            whole = on_whole_mesh(partial(fun, **kwargs), has_aux, None, config)
            out, grads = whole(given, batch, key, None)
            value, (aux, _) = out
            return ((value, aux) if has_aux else value), grads
        value = metrics["loss"]
        grads = Grads(parts, region.taken, region.part_axes, Grads.splits_of(plan))
        return ((value, metrics.get("aux")) if has_aux else value), grads

    return run


CLOSURE = (
    "zeroshard: tx.value_and_grad runs your loss on each device's rows (jax.shard_map), "
    "where jax does not take a value of your traced step closed over by the loss on a mesh "
    "with Explicit axes: pass it as a keyword argument instead, f(params, batch, "
    "scale=opt_state.loss_scale.scale) for loss_fn(params, batch, scale)."
)

REFUSED = (ValueError, NotImplementedError)
"""What jax raises for a sharding call over a manual axis: a ``PartitionSpec`` naming
it (``ValueError``), or ``auto_axes`` leaving it (``NotImplementedError``)."""


class Refusals:
    """``loss_fn``, recording jax's refusal of a sharding call over an axis the loss
    region runs manual over (:data:`REFUSED`: an ``out_sharding=`` or ``reshard``
    naming the batch axis, an ``auto_axes`` such as ``nnx.Embed``'s ``out_sharding=``
    leaving it), raised while traced. Such a loss trains under the user's own
    ``jax.jit`` on the mesh, and so it does on the whole mesh (:func:`on_whole_mesh`)."""

    def __init__(self, loss_fn: Callable[..., Any]):
        self.loss_fn, self.error = loss_fn, None

    def loss(self, *args: Any, **kwargs: Any) -> Any:
        """``loss_fn``, recording what it raises."""
        try:
            return self.loss_fn(*args, **kwargs)
        except REFUSED as error:  # (jax's, not another error of the loss)
            if any(m in str(error) for m in ("of type Auto or Manual", "from `Manual`")):
                self.error = error
            raise


def on_whole_mesh(fun: Callable[..., Any], has_aux: bool, scale: Any, config: Any) -> Callable:
    """``jax.value_and_grad`` of ``fun`` in the step's convention
    (:func:`zeroshard.training.step_io.step_loss`, times the loss ``scale``, if any) on
    the global batch, under ``jax.jit`` on the mesh as given: the compiler reduces the
    gradient. ``zs.gather`` / ``zs.layer`` gather stage 3's weights as in the user's own
    ``jax.jit``."""
    value_and_grad = jax.value_and_grad(step_io.step_loss(fun, has_aux, scale), has_aux=True)

    def run(*args: Any) -> tuple:
        with in_step(StepContext(config.batch_axes, None, replica_axis=config.replica_axis)):
            return value_and_grad(*args)

    return run


def check_whole_mesh(
    opt: Any, mesh: Any, accum_steps: int, error: Exception, entry: str, same_layout: bool = True
) -> None:
    """Raises ``error`` (the loss's refusal per device) with a note naming what the
    whole mesh cannot run: ``accum_steps``; the options ``jax.grad``'s gradient cannot
    take (``deterministic=``, ``quantize_grads``, at stage 3 ``quantize_weights``); and,
    for a step's state laid out otherwise than the drop-in's (``same_layout``), an
    ``axis_name`` not first among the mesh's."""
    config = opt.config
    three = kept_apart(config.stage)[2]
    try:  # (jax.grad reduces the gradients there: in its order, not quantized)
        config.check_in_jit(mesh, pieces=three)
        fixed = False
    except ValueError:
        fixed = True
    quantized = "quantize_grads or quantize_weights" if three else "quantize_grads"
    refused = {
        f"accum_steps={accum_steps}": accum_steps > 1,
        f"deterministic, {quantized}": fixed,
        "an axis_name not first among the mesh's axes": not same_layout,
    }
    if any(refused.values()):
        error.add_note(
            "zeroshard: the loss's own sharding calls do not run per device "
            "(they name the batch axis, pass a PartitionSpec to reshard, or leave it with "
            f"auto_axes). {entry} runs such a loss on the whole mesh instead, but not with "
            f"{', '.join(k for k, v in refused.items() if v)}: leave it out, or train with "
            "zs.sharded(...) and jax.grad in your own jax.jit step."
        )
        raise error
    logger.info(
        "zeroshard: the loss does not run per device (%s); %s runs it on the whole mesh "
        "(its gradient all-reduced by the compiler).",
        str(error).splitlines()[0],
        entry,
    )
