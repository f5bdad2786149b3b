"""Sums: the inner update evaluated with its sums made whole.

Where the traced update uses a sum over this device's elements in a non-linear way (a
leaf's norm, as LAMB's and LARS's trust ratios need; an RMS, as Adafactor's update
clipping; a global norm over several leaves, as ``optax.clip_by_global_norm``), the
tags of :mod:`zeroshard.analysis.tags` say where (:class:`~zeroshard.analysis.tags.Sums`);
:func:`evaluate` then evaluates the update's jaxpr equation by equation, with a
``psum`` over the sharding axis inserted on those partial sums, so every device uses
the sum over whole leaves. How a partial sum becomes the leaf's total is the step's
order of sums (:class:`Psum`): a ``psum``, or the leaf's total in a fixed
order (``deterministic=``), the same on every device count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.analysis.jaxprs import ELEMENTWISE, RESHAPING, walk
from zeroshard.analysis.tags import Program, Sums, Tag, Tagger
from zeroshard.communication.collectives import varies, vary
from zeroshard.core.layout import Slot

# Evaluated on invariant operands, these give the same value on every device.
_MIXING = "reduce_sum reduce_max reduce_min dot_general transpose concatenate pad slice"
_FREE_TYPED = ELEMENTWISE | RESHAPING | frozenset(_MIXING.split())


@dataclasses.dataclass(frozen=True)
class Psum:
    """The order of a step's sums where the collectives and the compiler choose it (the
    default): a partial sum in the update is ``psum``-ed over the axis where it is
    used, and the bits of a sum follow the device count. It and its subclass
    :class:`zeroshard.communication.canonical.FixedOrder` (``deterministic=``) are the one object
    :attr:`zeroshard.ShardConfig.sum_order` chooses; the plan, the evaluation below,
    and the step's checks ask it, and no module tests the option.

    Attributes:
      chunks: the canonical chunks a leaf's layers are cut into (none: ``0``).
      any_order: whether sums may run in any order, so alike leaves may be updated
        as one buffer, a whole-tensor update may run on blocks, and a stage-2 step
        may reduce its gradients layer by layer (:mod:`zeroshard.training.held`).
      rewrites: whether the inner update is evaluated equation by equation even
        where no sum needs making whole.
    """

    chunks = 0
    any_order = True
    rewrites = False

    def over(self, slots: Sequence[Slot]) -> Psum:
        """This order for a plan's leaves (``slots``)."""
        return self

    def check_drop_in(self) -> None:
        """Refuses an order the user's own step cannot keep (none here)."""

    def check_devices(self, num_shards: int, axes: str | tuple[str, ...]) -> None:
        """Refuses a state over ``num_shards`` devices (of ``axes``) that this order's
        chunks cannot be cut over (none here)."""

    def made_whole(self, sums: Any, xs: list, axis: str) -> list:
        """Operands whose partial sums (``sums.summed``) are summed over ``axis``."""
        return [jax.lax.psum(x, axis) if k in sums.summed else x for k, x in enumerate(xs)]

    def total(self, eqn: Any, sums: Any, xs: list, axis: str) -> list | None:
        """``eqn``'s outputs where it is a sum this order takes itself, else ``None``."""
        return None

    def divided(self, eqn: Any, sums: Any, xs: list, scalars: dict) -> list | None:
        """``eqn``'s outputs where it is a division this order rewrites, else ``None``
        (``scalars``: what it notes of the equations before, by variable)."""
        return None


PSUM = Psum()


def run_with_sums(
    fn: Any,
    args: tuple,
    in_tags: list[Tag],
    axis_name: str,
    leaf_names: list[str],
    sliced: Mapping[int, Slot],
    order: Psum = PSUM,
) -> Any:
    """``fn(*args)``, evaluated from its jaxpr with each sum over the elements of the
    ``sliced`` leaves (this device's pieces) made the sum over the whole leaf where it
    meets a non-linear operation: summed over ``axis_name``, padding left out, a mean
    divided by the leaf's size (see :class:`zeroshard.analysis.tags.Tagger`). Inputs
    past ``in_tags`` are clean. ``order`` (:class:`Psum` or a subclass, over the plan's
    leaves) says how the partial sums become totals."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    program = Tagger(axis_name, leaf_names, sliced).run(closed, in_tags)[1]
    values = evaluate(closed, program, jax.tree.leaves(args), axis_name, order)
    return jax.tree.unflatten(jax.tree.structure(out_shape), values)


def evaluate(closed: Any, program: Program, values: list, axis_name: str, order: Psum) -> list:
    """The outputs of a (closed) jaxpr on ``values``, with the sums of ``program``
    made totals as ``order`` takes them."""
    sums, scalars = iter(program), {}  # (what order.divided notes, by variable)
    step = lambda eqn, xs: _eqn(eqn, next(sums), xs, axis_name, order, scalars)
    return walk(closed, values, step)


def bound(eqn: Any, sums: Sums | None, xs: list, axis: str) -> list:
    """The outputs of ``eqn`` on ``xs``, with its sums (as :func:`evaluate` binds each
    equation; for :mod:`zeroshard.core.blocks`, which evaluates blocked values alongside)."""
    return _eqn(eqn, sums, xs, axis, PSUM, {})


def _eqn(eqn: Any, sums: Sums | None, xs: list, axis: str, order: Psum, scalars: dict) -> list:
    xs = xs if sums is None else _exact(sums, xs, axis, order)
    if eqn.primitive.name == "pvary":  # a cast tracing inserted: made again where needed
        return xs
    total = order.total(eqn, sums, xs, axis)
    if total is not None:
        return total
    xs = _typed(eqn, xs, axis)
    if eqn.primitive.name == "cond":  # its branches evaluated here too, sums made whole inside
        return _switch(eqn, sums.branches, xs, axis, order)
    divided = order.divided(eqn, sums, xs, scalars)
    if divided is not None:
        return divided
    ys = eqn.primitive.bind(*xs, **eqn.params)  # not a call (inlined): bound with its params
    return ys if eqn.primitive.multiple_results else [ys]


def _vary(x: Any, axis: str, traced: bool) -> Any:
    """``x``, cast to varying over ``axis`` where it was ``traced`` so and is not."""
    return vary(x, axis) if traced else x


def _exact(sums: Sums, xs: list, axis: str, order: Psum) -> list:
    """Operands on a sliced leaf's piece made to give the leaf's own sums: padding left
    out of a total sum, a mean divided by the leaf's size, and partial sums made
    totals as ``order`` takes them (the same on every device, typed invariant)."""
    if sums.mask is not None:
        mask = sums.mask.padding_mask(jax.lax.axis_index(axis))
        xs = [jnp.where(mask.reshape(xs[0].shape), xs[0], 0), *xs[1:]]
    elif sums.size is not None:
        xs = [xs[0], _vary(jnp.asarray(sums.size, xs[1].dtype), axis, varies(xs[1], axis))]
    return order.made_whole(sums, xs, axis)


def _switch(eqn: Any, programs: tuple[Program, ...], xs: list, axis: str, order: Psum) -> list:
    """A conditional evaluated branch by branch; the outputs typed as traced where the
    branches' types differ."""

    def branch(b: Any, program: Program, typed: bool) -> Any:
        def run(*a: Any) -> list:
            outs = zip(evaluate(b, program, list(a), axis, order), eqn.outvars, strict=True)
            return [_vary(y, axis, typed and varies(v, axis)) for y, v in outs]

        return run

    pairs = list(zip(eqn.params["branches"], programs, strict=True))
    try:
        return jax.lax.switch(xs[0], [branch(b, p, False) for b, p in pairs], *xs[1:])
    except TypeError:  # the branches' output types differ: type them as traced
        return jax.lax.switch(xs[0], [branch(b, p, True) for b, p in pairs], *xs[1:])


def _typed(eqn: Any, xs: list, axis: str) -> list:
    """``eqn``'s operands typed varying over the axis where it needs them so.

    A sum made whole is typed invariant (the same on every device), where the
    traced jaxpr had it varying; so is what is computed from it alone (the new
    value of a replicated state leaf, such as novograd's per-leaf second moment,
    stays replicated). Such an operand is cast back to varying where it meets a
    varying one, as tracing would have cast it, and where the equation is a
    collective or a loop (bound as traced)."""
    traced = [varies(v, axis) for v in eqn.invars]
    cast = any(t and not varies(x, axis) for t, x in zip(traced, xs, strict=True))
    if not cast or (eqn.primitive.name in _FREE_TYPED and not any(varies(x, axis) for x in xs)):
        return xs
    return [_vary(x, axis, t) for t, x in zip(traced, xs, strict=True)]
