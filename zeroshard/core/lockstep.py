"""Lockstep: a ``lax.switch`` on the device's index whose branches hold collectives,
run so that every device meets every collective, in one order.

Devices that own different leaves run different branches
(:mod:`zeroshard.core.branches`), and the inner update in a branch can hold
collectives: the ``psum`` of a global norm (``optax.clip_by_global_norm``), of
LAMB's per-leaf norms, the fixed-order totals of ``deterministic=``. A collective
inside a branch is an instruction of that branch only. XLA's CPU runtime in jax 0.12.1
meets a collective's participants by its instruction, so the device that runs the
owner's branch waits in its ``psum`` while the others wait in theirs, and the step
hangs until the runtime's rendezvous timeout aborts the process. The runtimes of
jax 0.10.2 and 0.12.0.1 paired any two all-reduces of the program (each of a
``shard_map``'s collectives carries ``channel_id=1``), so they met by accident. A
minimal program in plain jax::

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    def f(x):  # device 0 takes branch 1, the others branch 0
        i = (jax.lax.axis_index("d") == 0).astype(jnp.int32)
        return jax.lax.switch(i, [lambda x: jax.lax.psum(x, "d"),
                                  lambda x: jax.lax.psum(2 * x, "d")], x)

returns 28 on every device for ``arange(8.0)`` on jax 0.10.2 and 0.12.0.1, and hangs on 0.12.1.

So the collectives are taken out of the branches (:func:`switch`). Each branch is
traced once; its collectives are numbered in the order the branch reaches them
(through the branches of a nested conditional one after the other) and must pair
one to one across the branches (the same primitive, parameters and operand types:
the branches run one update on different views). A collective's *level* is the
number of collectives its operands wait on, one after another. Level by level, one
``lax.switch`` computes the operands of that level's collectives on each device (a
nested conditional evaluated as all its branches and a select, only what the
operands need kept: the compiler removes the rest), then the collectives run outside
it, the same ones in the same order on every device; the last ``lax.switch`` runs
the branches whole, with each collective's result taken from outside. Every
operation runs on the same operands as in the branch itself: the bits are the same.

A collective inside a ``scan`` (a ``fori_loop`` of concrete bounds is one: Muon's
Newton-Schulz iteration over a blocked leaf) is taken out by unrolling that loop
first: its body is traced ``length`` times, on the slices of its scanned operands,
as jax itself lowers a scan unrolled whole (``unroll=True``). Only a ``while`` loop
of a traced trip count keeps its collectives in the branch. (Cut at its collectives,
a branch can be fused differently by XLA: on jax 0.10.2, Muon over a blocked leaf on 2
devices in stage 3, which ran as a plain ``lax.switch`` before, differs in the last
bits: a norm's ``reduce_sum`` is fused with the elementwise operations before it.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from zeroshard.analysis.jaxprs import called_jaxpr, open_jaxpr, primitives, scan_parts, walk
from zeroshard.communication.collectives import vary, varying_axes

# The primitives that communicate across devices (names of jax 0.10 to 0.12).
COLLECTIVES = frozenset(
    """
    psum psum_invariant pmax pmin all_gather all_gather_invariant reduce_scatter
    psum_scatter all_to_all ragged_all_to_all ppermute pgather pbroadcast psend precv
    """.split()
)


def switch(index: jax.Array, branches: Sequence[Callable[..., Any]], *args: Any) -> Any:
    """``jax.lax.switch(index, branches, *args)`` with no collective inside the
    conditional: the branches' collectives run outside it, in one order on every
    device (see the module's docstring). Branches without collectives give the plain
    ``lax.switch`` (of the branches as traced here).

    A ``scan`` holding collectives is unrolled first (:func:`unroll_scans`). A
    collective inside a ``while`` loop in a branch cannot be taken out: such branches
    run as ``lax.switch`` runs them (as every runtime but jax 0.12.1's CPU one pairs
    them).

    Raises:
      ValueError: if the branches' collectives do not pair one to one.
    """
    flat, tree = jax.tree.flatten(args)
    call = lambda f: lambda *xs: f(*jax.tree.unflatten(tree, xs))
    traced = [jax.make_jaxpr(call(f), return_shape=True)(*flat) for f in branches]
    closed = [c for c, _ in traced]
    if any(_scans(c) for c in closed):  # (the others' jaxprs stay as traced)
        closed = [unroll_scans(c, flat) if _scans(c) else c for c in closed]
    try:
        found = [collective_eqns(c) for c in closed]
    except InLoop:  # (a while loop's: the branches as they are, as jax runs them)
        found = []
    if not any(found):  # (the traced branches, not traced again)
        outs = jax.lax.switch(index, [jex_core.jaxpr_as_fun(c) for c in closed], *flat)
        return jax.tree.unflatten(jax.tree.structure(traced[0][1]), outs)
    _check_pairs(found)
    level = [max(ls) for ls in zip(*[levels(c, len(flat)) for c in closed], strict=True)]
    fed: dict[int, list] = {}
    for now in range(max(level) + 1):
        ks = [k for k, at in enumerate(level) if at == now]
        operands = jax.lax.switch(index, [_operands(c, fed, ks) for c in closed], *flat)
        operands = iter(operands)
        for k in ks:  # the same collectives in the same order on every device
            eqn = found[0][k]
            fed[k] = _bind(eqn, [next(operands) for _ in eqn.invars])
    outs = jax.lax.switch(index, [_whole(c, fed) for c in closed], *flat)
    return jax.tree.unflatten(jax.tree.structure(traced[0][1]), outs)


def unroll_scans(closed: Any, args: Sequence[Any]) -> Any:
    """A (closed) jaxpr of the same inputs and outputs, traced on ``args``, whose
    ``scan`` loops holding collectives (in calls and conditionals too, and nested) are
    unrolled: the body traced once per iteration, on the slices of the scanned
    operands (in reverse for ``reverse=True``), its outputs stacked; as jax lowers a
    scan of ``unroll=True``. Other equations are bound as they are."""

    def step(eqn: Any, xs: list) -> list:
        name = eqn.primitive.name
        if name == "scan" and _holds(eqn):
            consts, carry, scanned = scan_parts(eqn, xs)
            length, reverse = eqn.params["length"], eqn.params["reverse"]
            rows = []
            for i_ in range(length):
                i = length - 1 - i_ if reverse else i_
                x = [jax.lax.index_in_dim(a, i, keepdims=False) for a in scanned]
                out = walk(eqn.params["jaxpr"], [*consts, *carry, *x], step)
                carry, row = out[: len(carry)], out[len(carry) :]
                rows.append(row)
            rows = rows[::-1] if reverse else rows
            ys = [
                jax.lax.concatenate([jax.lax.expand_dims(r, (0,)) for r in col], 0)
                for col in zip(*rows, strict=True)
            ] or [_zeros(v) for v in eqn.outvars[len(carry) :]]
            outs = [*carry, *ys]
        elif name == "cond" and _scans(eqn):
            run = lambda b: lambda *zs: walk(b, list(zs), step)
            outs = jax.lax.switch(xs[0], [run(b) for b in eqn.params["branches"]], *xs[1:])
        else:
            return _bind(eqn, xs)
        return [vary(y, tuple(varying_axes(v))) for y, v in zip(outs, eqn.outvars, strict=True)]

    return jax.make_jaxpr(lambda *xs: walk(closed, list(xs), step))(*args)


def _scans(x: Any) -> bool:
    """Whether a (closed) jaxpr, or an equation, holds a ``scan`` that holds a
    collective (in calls, conditionals and loops too)."""
    if open_jaxpr(x) is not None:
        return any(map(_scans, open_jaxpr(x).eqns))
    return (x.primitive.name == "scan" and _holds(x)) or any(map(_scans, _subjaxprs(x)))


class InLoop(ValueError):
    """A collective inside a loop in a branch: it cannot be taken out of the branch."""


def collective_eqns(closed: Any) -> list:
    """The collective equations of a (closed) jaxpr in the order it reaches them: calls
    walked into, a conditional's branches one after the other.

    Raises:
      InLoop: for a collective inside a loop.
    """
    found = []
    for eqn in open_jaxpr(closed).eqns:
        name, sub = eqn.primitive.name, called_jaxpr(eqn)
        if name in COLLECTIVES:
            found.append(eqn)
        elif name == "cond":
            for branch in eqn.params["branches"]:
                found += collective_eqns(branch)
        elif sub is not None and name not in ("scan", "while"):  # a call: walked into
            found += collective_eqns(sub)
        elif _holds(eqn):
            raise InLoop(
                f"A collective inside a {name} in one device's branch of the sharded "
                "update cannot be run by every device in one order; place the leaves "
                "whose update it is in as sliced (placement=...), not owned."
            )
    return found


def levels(closed: Any, num_inputs: int) -> list[int]:
    """Per collective of :func:`collective_eqns`, how many collectives its operands wait
    on, one after another (0: none)."""
    found = []

    def step(eqn: Any, xs: list) -> list:
        at = max(xs, default=0)
        if eqn.primitive.name in COLLECTIVES:
            found.append(at)
            return [at + 1] * len(eqn.outvars)
        if eqn.primitive.name == "cond" and _holds(eqn):
            outs = [walk(b, xs[1:], step, clean=0) for b in eqn.params["branches"]]
            return [max(at, *ys) for ys in zip(*outs, strict=True)]
        return [at] * len(eqn.outvars)

    walk(closed, [0] * num_inputs, step, clean=0)
    return found


def _operands(closed: Any, fed: dict, wanted: list[int]) -> Callable[..., list]:
    """A branch giving the operands of collectives ``wanted``: the collectives before
    them fed their results, later ones a zero stand-in, nested conditionals evaluated
    as all their branches and a select."""

    def run(*xs: Any) -> list:
        counter, caught = iter(range(len(collective_eqns(closed)))), {}

        def step(eqn: Any, ys: list) -> list:
            if eqn.primitive.name in COLLECTIVES:
                k = next(counter)
                caught[k] = ys
                return fed[k] if k in fed else [_zeros(v) for v in eqn.outvars]
            if eqn.primitive.name == "cond" and _holds(eqn):
                outs = [walk(b, ys[1:], step) for b in eqn.params["branches"]]
                return [
                    _select(ys[0], zs, v)
                    for zs, v in zip(zip(*outs, strict=True), eqn.outvars, strict=True)
                ]
            return _bind(eqn, ys)

        walk(closed, list(xs), step)
        return [x for k in wanted for x in caught[k]]

    return run


def _whole(closed: Any, fed: dict, start: int = 0) -> Callable[..., list]:
    """A branch run whole from collective number ``start`` on, each collective's result
    taken from ``fed``; a nested conditional holding collectives bound again, each of
    its branches from its own first collective's number."""

    def run(*xs: Any) -> list:
        counter = iter(range(start, start + len(collective_eqns(closed))))

        def step(eqn: Any, ys: list) -> list:
            if eqn.primitive.name in COLLECTIVES:
                return fed[next(counter)]
            if eqn.primitive.name != "cond" or not _holds(eqn):
                return _bind(eqn, ys)
            runs = []
            for b in eqn.params["branches"]:
                firsts = [next(counter) for _ in collective_eqns(b)]
                runs.append(_whole(b, fed, firsts[0]) if firsts else _whole(b, fed))
            outs = jax.lax.switch(ys[0], runs, *ys[1:])
            return [vary(y, tuple(varying_axes(v))) for y, v in zip(outs, eqn.outvars, strict=True)]

        return walk(closed, list(xs), step)

    return run


def _check_pairs(found: list[list]) -> None:
    """Refuses branches whose collectives do not pair one to one."""
    first = found[0]
    for other in found[1:]:
        alike = len(other) == len(first) and all(
            a.primitive == b.primitive
            and a.params == b.params
            and [(v.aval.shape, v.aval.dtype) for v in a.invars]
            == [(v.aval.shape, v.aval.dtype) for v in b.invars]
            for a, b in zip(first, other, strict=True)
        )
        if not alike:
            raise ValueError(
                "The devices' branches of the sharded update run different collectives, "
                "which no device order can pair (a deadlock on XLA's CPU runtime); place "
                "the leaves whose update sums across devices as sliced (placement=...)."
            )


def _bind(eqn: Any, xs: list) -> list:
    ys = eqn.primitive.bind(*xs, **eqn.params)
    return list(ys) if eqn.primitive.multiple_results else [ys]


def _zeros(v: Any) -> jax.Array:
    """A zero stand-in typed as variable ``v``."""
    return vary(jnp.zeros(v.aval.shape, v.aval.dtype), tuple(varying_axes(v)))


def _select(index: jax.Array, cases: Sequence[jax.Array], v: Any) -> jax.Array:
    """Case ``index`` of ``cases``, typed as variable ``v``."""
    axes = tuple(varying_axes(v) | varying_axes(index))
    cases = [vary(c, axes) for c in cases]
    which = vary(jnp.broadcast_to(index, jnp.shape(cases[0])), axes)
    return jax.lax.select_n(which, *cases) if len(cases) > 1 else cases[0]


def _subjaxprs(eqn: Any) -> list:
    subs = []
    for p in eqn.params.values():
        subs += [s for s in (p if isinstance(p, tuple) else (p,)) if open_jaxpr(s) is not None]
    return subs


def _holds(x: Any) -> bool:
    """Whether a (closed) jaxpr, or an equation's jaxprs, hold a collective."""
    if open_jaxpr(x) is not None:
        return bool(COLLECTIVES & set(primitives(x)))
    return any(map(_holds, _subjaxprs(x)))
