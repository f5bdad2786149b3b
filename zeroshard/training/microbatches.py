"""Micro-batches: how a step turns its device's rows into a loss and gradient parts.

One strategy per step, chosen with its route (:meth:`zeroshard.core.update.Route.of`):

- :class:`OneBatch`: the device's rows at once; its gradients arrive by the route's
  arrival;
- :class:`Accumulated`: ``accum_steps`` micro-batches in a scan, their mean taken;
  stage 1 carries the full local gradient, stages 2 and 3 a 1/N accumulator of parts;
- :class:`InOrder`: the fixed-order step of ``deterministic=``
  (:mod:`zeroshard.communication.canonical`): the global batch's ``parts`` micro-batches summed in
  one binary tree, across devices in device order; its loss, aux and model state
  come back global already (:attr:`InOrder.reduced`).

Each returns ``((loss, (aux, model_state)), parts)`` from :meth:`OneBatch.run`, and says how
the batch must split (:meth:`OneBatch.check_batch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from zeroshard.communication import canonical
from zeroshard.communication.collectives import all_gathered, vary
from zeroshard.communication.stage3 import is_shard
from zeroshard.core.layout import PyTree, is_floating
from zeroshard.optimizer.checks import check_batch
from zeroshard.training import step_io


@dataclasses.dataclass(frozen=True)
class OneBatch:
    """The device's rows in one forward and backward pass.

    Attributes:
      axes: the batch axes: the replica axis, if any, then the sharding axis (one
        axis: its name).
      steps: the micro-batches of each device's rows.
      each: whether each micro-batch's gradient arrives on its own, into a 1/N
        accumulator (stages 2 and 3: :meth:`zeroshard.communication.arrival.Arrival.part`); else
        the full local gradient is summed and arrives once (stage 1).
      reduced: whether :meth:`run`'s loss, aux and model state are global already.
    """

    axes: str | tuple[str, ...]
    steps: int = 1
    each: bool = False
    reduced = False

    def check(self, num_devices: int) -> None:
        """Refuses a device count this strategy cannot run on (none here)."""

    def check_batch(self, batch: PyTree, num_devices: int) -> None:
        """Refuses a batch that does not split evenly over the devices (and their
        micro-batches)."""
        check_batch(batch, num_devices, self.axes, self.steps)

    def run(self, value_and_grad: Callable, params, batch, key, model_state, plan, arrival):
        """The loss, aux, model state and this device's gradient parts."""
        key = step_io.device_key(key, self.axes)
        out, grads = value_and_grad(params, batch, key, model_state)
        return out, arrival.bring(plan, grads)


@dataclasses.dataclass(frozen=True)
class Accumulated(OneBatch):
    """``steps`` micro-batches in a scan: the mean loss and gradient, per-example aux
    concatenated in batch order (other aux averaged), the model state after the last
    micro-batch; micro-batch ``i`` gets ``fold_in(key, i)``.

    Stage 1 carries the full local gradient in fp32 and reduce-scatters it once.
    Stages 2 and 3 (:attr:`each`) carry a 1/N fp32 accumulator of pieces, reduced
    per micro-batch, so no full-size gradient buffer lives across micro-batches.
    """

    def run(self, value_and_grad: Callable, params, batch, key, model_state, plan, arrival):
        k, axes, key = self.steps, self.axes, step_io.device_key(key, self.axes)
        # (laid out as the parts are: over the state's other axes, if any; from the shape's
        # sharding alone: zeros_like drops it outside jax.set_mesh, and fails on the shape's
        # manual axis type where the mesh's other axes are Auto; typed varying by vary)
        zeros = lambda x: vary(jnp.zeros(x.shape, jnp.float32, out_sharding=x.sharding), axes)
        # What a micro-batch adds: its gradient (stage 1), or its part (stage 2's
        # reduce-scattered parts, stage 3's pieces: the owned ones go to their owners once).
        add = (lambda grads: arrival.part(plan, grads)) if self.each else (lambda grads: grads)
        accumulator = jax.tree.map(zeros, jax.eval_shape(add, params))

        def body(carry, xs):
            model_state, acc = carry
            mb, i = xs
            mb_key = None if key is None else jax.random.fold_in(key, i)
            (loss, (aux, model_state)), grads = value_and_grad(params, mb, mb_key, model_state)
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, add(grads))
            return (model_state, acc), (loss, aux)

        xs = (step_io.split_rows(batch, k), jnp.arange(k))
        (model_state, acc), (losses, auxes) = jax.lax.scan(body, (model_state, accumulator), xs)
        rows = step_io.local_rows(batch) // k
        aux = jax.tree.map(lambda x: step_io.stacked_aux(x, rows), auxes)
        out = (jnp.mean(losses.astype(jnp.float32)), (aux, model_state))
        acc = jax.tree.map(lambda a: a / k, acc)
        return out, arrival.parts(plan, acc) if self.each else arrival.bring(plan, acc)


@dataclasses.dataclass(frozen=True)
class InOrder(OneBatch):
    """The fixed-order step (``deterministic=parts``): device ``d``'s rows are
    micro-batches ``d * R`` to ``(d + 1) * R - 1`` of the global batch's ``parts``
    (``R = parts / N`` rounds); round ``i`` computes its micro-batch ``i`` (the key
    folded with its index in the global batch, from the model state as given).
    Stage 1 sums its rounds first and then the devices' sums, with one
    ``all_to_all``; stages 2 and 3 sum every round across the devices, then the
    rounds. Each in its fixed tree; the sums are divided by ``parts``. Per-example
    aux comes back in batch order."""

    parts: int = 2
    accum_steps: int = 1
    reduced = True

    def __post_init__(self) -> None:
        if self.accum_steps != 1:
            raise ValueError(
                f"deterministic={self.parts} cuts the global batch into {self.parts} "
                f"micro-batches itself ({self.parts} // N per device), so accum_steps="
                f"{self.accum_steps} has nothing to add: leave it at 1 and choose "
                "deterministic= for the micro-batch size you can afford."
            )

    def check(self, num_devices: int) -> None:
        """Refuses a device count that does not leave each device at least two of the
        ``parts`` micro-batches (a gradient computed outside a loop compiles to other
        bits than inside one)."""
        parts = self.parts
        if parts % num_devices or parts // num_devices < 2:
            raise ValueError(
                f"deterministic={parts} gives the same bits on the device counts that leave "
                f"each device at least two of its {parts} micro-batches (powers of two up to "
                f"{parts // 2}; with one, the compiler lays the gradient out another way), but "
                f"{self.axes!r} has {num_devices} devices: pass "
                f"deterministic={2 * num_devices} or a larger power of two."
            )

    def check_batch(self, batch: PyTree, num_devices: int) -> None:
        what = f"the deterministic={self.parts} micro-batches"
        check_batch(batch, num_devices, self.axes, parts=(self.parts, what))

    def run(self, value_and_grad: Callable, params, batch, key, model_state, plan, arrival):
        axis, apart = self.axes, self.each  # (one batch axis)
        rounds, aux_of = self.parts // jax.lax.axis_size(axis), {}
        f32 = lambda x: x.astype(jnp.float32)
        micro, rows = step_io.split_rows(batch, rounds), step_io.local_rows(batch) // rounds
        # stage 3's pieces' gradients summed in float32 (canonical.gathered)
        params = jax.tree.map(
            lambda x: jax.tree.map(f32, x) if is_shard(x) else x, params, is_leaf=is_shard
        )
        order = canonical.HIGH if apart else canonical.LOW
        # (N, ...), in device order, the same on every device
        devices = lambda x: all_gathered(x, axis, to="invarying")
        across = lambda x: canonical.tree_sum(devices(f32(x)), order=order)
        # Per round: stage 1 keeps this device's values, stages 2 and 3 sum the devices'.
        per_round = across if apart else f32

        def one(i):
            index = jax.lax.axis_index(axis) * rounds + i  # its place in the global batch
            mb_key = None if key is None else jax.random.fold_in(key, index)
            mb = jax.tree.map(lambda x: x[i], micro)
            (loss, (aux, state)), grads = value_and_grad(params, mb, mb_key, model_state)
            grads = arrival.part(plan, grads) if apart else grads
            aux, aux_of["tree"] = jax.tree.flatten(aux)
            aux_of["each"] = each = [step_io.is_per_example(x, rows) for x in aux]
            state = jax.tree.map(lambda x: per_round(x) if is_floating(x) else x, state)
            scalar = [per_round(x) for x, e in zip(aux, each, strict=True) if not e]
            rest = [x for x, e in zip(aux, each, strict=True) if e]
            return (jax.tree.map(f32, grads), per_round(loss), scalar, state), rest

        (parts, loss, scalar, new_state), rest = canonical.in_order(one, rounds, order)
        if not apart:  # the devices' sums of their rounds, summed in device order
            parts, loss, scalar = (
                arrival.bring(plan, parts),
                across(loss),
                list(map(across, scalar)),
            )
        mean = lambda x: x / self.parts
        parts = jax.tree.map(mean, parts)
        parts = arrival.parts(plan, parts) if apart else parts
        ordered = lambda x: devices(x).reshape(-1, *x.shape[1:])  # in batch order
        scalar, rest = iter(map(mean, scalar)), iter(map(ordered, rest))
        aux = [next(rest) if e else next(scalar) for e in aux_of["each"]]
        state = lambda x, y: (
            mean(x if apart else across(x)).astype(y.dtype) if is_floating(y) else devices(x)[0]
        )
        new_state = jax.tree.map(state, new_state, model_state)
        return (mean(loss), (aux_of["tree"].unflatten(aux), new_state)), parts
