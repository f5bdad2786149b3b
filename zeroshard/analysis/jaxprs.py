"""Jaxprs: reading traced computations, the same way on every supported jax version.

The analysis (:mod:`zeroshard.analysis`) and :mod:`zeroshard.core.sums` read the traced inner update
equation by equation, each with :func:`walk`; these are the primitives they treat alike and the
helpers that find the jaxprs an equation calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.extend import core as jex_core

# Primitives computing each output element from the same element of each operand.
ELEMENTWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz conj complex
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2
    expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or population_count pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    """.split()
)
# Casts and annotations: the value passes through unchanged (its layout may change).
PASS_THROUGH = frozenset(
    "sharding_constraint pvary pcast optimization_barrier reshard mesh_cast".split()
)
KEEPS_SHAPE = ELEMENTWISE | PASS_THROUGH
# Reshapes that keep the elements' order.
RESHAPING = frozenset(["reshape", "squeeze", "expand_dims", "broadcast_in_dim"])


def open_jaxpr(x: Any) -> Any:
    """The open jaxpr of a ``Jaxpr`` or ``ClosedJaxpr`` (whose classes vary by jax version)."""
    if hasattr(getattr(x, "jaxpr", None), "eqns"):
        return x.jaxpr
    return x if hasattr(x, "eqns") and hasattr(x, "invars") else None


def called_jaxpr(eqn: Any) -> Any:
    """The (closed, where it has constants) jaxpr an equation calls, if any."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if open_jaxpr(sub) is not None:
            return sub
    return None


def scan_parts(eqn: Any, ins: list) -> tuple[list, list, list]:
    """A ``scan`` equation's operands (``ins``, one per operand) as its constants, its
    carries and its scanned inputs: counted by named parameters up to jax 0.10, one
    group per kind in ``ft_in`` since."""
    params = eqn.params
    if "num_consts" in params:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
    else:
        consts, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
        n_consts, n_carry = len(list(consts)), len(list(carry))
    return ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]


def walk(closed: Any, ins: list, step: Callable[[Any, list], list], clean: Any = None) -> list:
    """The values of a (closed) jaxpr's outputs from its inputs' values ``ins``: equation
    by equation, ``step(eqn, operands)`` gives its outputs' values, except that a call
    (``pjit``, a custom derivative, ``remat``: any jaxpr an equation calls but a loop's or
    a conditional's) is walked into, inlined. With ``clean``, it is the value of every
    literal, constant and input past ``ins`` (a tag); without, they are their own values."""
    jaxpr = open_jaxpr(closed)
    consts = getattr(closed, "consts", ()) if clean is None else ()
    env = dict(zip(jaxpr.constvars, consts, strict=False))
    env.update(zip(jaxpr.invars, ins, strict=False))
    literal = (lambda v: v.val) if clean is None else (lambda v: clean)
    read = lambda v: env.get(v, clean) if isinstance(v, jex_core.Var) else literal(v)
    for eqn in jaxpr.eqns:
        xs = [read(v) for v in eqn.invars]
        sub = called_jaxpr(eqn)
        call = sub is not None and eqn.primitive.name not in ("scan", "while", "cond")
        ys = walk(sub, xs, step, clean) if call else step(eqn, xs)
        env.update(zip(eqn.outvars, ys, strict=True))
    return [read(v) for v in jaxpr.outvars]


def has_matmul(eqn: Any) -> bool:
    """Whether ``eqn`` is a matrix product, or a loop (``scan``, ``while``) with one."""
    subs = (called_jaxpr(eqn), eqn.params.get("body_jaxpr"))  # a scan's, a while loop's
    matmul = lambda s: s is not None and "dot_general" in primitives(s)
    return eqn.primitive.name == "dot_general" or any(map(matmul, subs))


def primitives(jaxpr: Any) -> list[str]:
    """A (closed) jaxpr's primitives in order, recursively, less pure reshapes."""
    names = []
    for eqn in open_jaxpr(jaxpr).eqns:
        if eqn.primitive.name not in RESHAPING:
            names.append(eqn.primitive.name)
        for p in eqn.params.values():
            for s in p if isinstance(p, tuple) else (p,):
                if open_jaxpr(s) is not None:
                    names += primitives(s)
    return names
