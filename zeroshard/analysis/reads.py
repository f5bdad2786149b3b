"""Reads: whether a loss reads its parameters only through :func:`zeroshard.gather`.

A stage-2 step whose loss gathers every parameter before using it (with
:func:`zeroshard.gather` or :func:`zeroshard.layer`, as a stage-3 loss must) can
reduce-scatter each gathered layer's gradient as soon as the backward pass makes it
(:mod:`zeroshard.training.held`). Whether it does is read from the loss traced once on the whole
parameters, with every gather marked (:func:`marking`, :func:`mark`): the loss
qualifies when no traced operation but a mark takes a parameter, or a value computed
from one, before it is marked. Loops over stacked layers (``scan``), conditionals and
calls (``pjit``, custom derivatives, ``remat``) are followed into; any other use (an
``astype`` before the gather, a norm over ``jax.tree.leaves(params)``, a parameter
returned in aux, a parameter read inside a ``while`` loop) reads it directly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching

from zeroshard.analysis.jaxprs import scan_parts, walk

_marked = jex_core.Primitive("zeroshard_gathered")
_marked.def_impl(lambda x: x)
_marked.def_abstract_eval(lambda x: x)
ad.primitive_jvps[_marked] = lambda primals, tangents: (mark(primals[0]), tangents[0])
batching.primitive_batchers[_marked] = lambda args, dims: (mark(args[0]), dims[0])

_marking: contextvars.ContextVar[bool] = contextvars.ContextVar("marking", default=False)


def mark(x: Any) -> Any:
    """``x``, marked as gathered in the traced computation (only while :func:`marking`;
    the mark is never compiled)."""
    return _marked.bind(x)


def is_marking() -> bool:
    """Whether a loss is being traced to read its gathers (:func:`marking`)."""
    return _marking.get()


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Inside: :func:`zeroshard.gather` marks the plain arrays it passes through."""
    token = _marking.set(True)
    try:
        yield
    finally:
        _marking.reset(token)


def reads_only_gathered(fn: Callable[..., Any], params: Any, *args: Any) -> bool:
    """Whether ``fn(params, *args)`` reads every leaf of ``params`` only through
    :func:`zeroshard.gather` (or not at all), traced on abstract values (nothing runs)."""
    with marking():
        closed = jax.make_jaxpr(fn)(params, *args)
    direct: list[str] = []
    n_params = len(jax.tree.leaves(params))
    n_args = len(closed.jaxpr.invars) - n_params
    step = lambda eqn, ins: _reads(eqn, ins, direct)
    outs = walk(closed, [True] * n_params + [False] * n_args, step, clean=False)
    return not direct and not any(outs)


def _reads(eqn: Any, ins: list[bool], direct: list[str]) -> list[bool]:
    """Which of ``eqn``'s outputs are read from a parameter not yet gathered (``ins``:
    which operands are); a direct read goes to ``direct``."""
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    if eqn.primitive is _marked or not any(ins):
        return [False] * n_out
    if name == "scan":
        return _scan(eqn, ins, direct)
    if name == "cond" and not ins[0]:
        step = lambda e, xs: _reads(e, xs, direct)
        outs = [walk(b, ins[1:], step, clean=False) for b in eqn.params["branches"]]
        return [any(x) for x in zip(*outs, strict=True)]
    direct.append(name)
    return [True] * n_out


def _scan(eqn: Any, ins: list[bool], direct: list[str]) -> list[bool]:
    """A ``scan``'s outputs read from parameters: its body followed, the carries until
    they settle."""
    consts, carry, xs = scan_parts(eqn, ins)
    step = lambda e, values: _reads(e, values, direct)
    while True:
        outs = walk(eqn.params["jaxpr"], [*consts, *carry, *xs], step, clean=False)
        settled = [a or b for a, b in zip(carry, outs[: len(carry)], strict=True)]
        if settled == list(carry):
            return outs
        carry = settled
