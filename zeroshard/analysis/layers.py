"""Layers: which stacked leaves' updates are independent layer by layer.

A leaf of stacked layers (``(L, ...)``, as a scan over layers keeps them) whose update
needs whole tensors may still treat each layer on its own: Muon with the layer axis
as a batch axis orthogonalises each layer's matrix; Adafactor factors each layer's
matrix separately. Such a leaf can be owned layer by layer, its layers spread over
the devices (see :mod:`zeroshard.placement`).

:func:`independent_layers` reads this from the traced update (the jaxpr of
``inner.update`` on the full parameters): it follows, for each candidate leaf, where
the layer axis is in every value derived from the leaf. Elementwise operations keep
it; reshapes, transposes and broadcasts move it; a reduction, contraction, slice or
reorder along it, or any operation not known to keep it, mixes layers. The leaf is
independent by layer if its update and each state leaf derived from it keep the
layer axis first, with no layer mixed on the way.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jex_core

from zeroshard.analysis.jaxprs import KEEPS_SHAPE, called_jaxpr, open_jaxpr, scan_counts

MIXED = None
"""The position of a leaf's layer axis in a value that mixes its layers."""

Axes = dict[int, int | None]
"""Per candidate leaf a value derives from, where its layer axis is (or ``MIXED``)."""

_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)


def independent_layers(
    closed: Any, in_axes: list[Axes], num_params: int
) -> tuple[set[int], set[int]]:
    """The candidate leaves (those in ``in_axes``) whose traced update is independent
    layer by layer, and of those the ones whose layers meet only through sums (a total
    ``reduce_sum``, as Adafactor's update clipping computes an RMS over the whole leaf):
    owned layer by layer, those sums are summed over the devices.

    Args:
      closed: the closed jaxpr of ``inner.update(grads, state, params, **extra)``:
        inputs the gradients, the state leaves, the parameters and the extra
        arguments; outputs the updates, then the new state leaves.
      in_axes: per input, its layer axes: the gradient and the parameter of a
        candidate at 0, each state leaf derived from one at 0 where it has that many
        layers first, else ``MIXED``; ``{}`` elsewhere.
      num_params: the number of parameter leaves.
    """
    sums: set[int] = set()
    outs = _run(closed, in_axes, sums)
    ok = {i for axes in in_axes for i in axes}
    for k, axes in enumerate(outs):
        for i, axis in axes.items():
            expected = 0 if k < num_params else in_axes[k].get(i, MIXED)
            if axis is MIXED or axis != expected:
                ok.discard(i)
    return ok, sums & ok


def _run(closed: Any, in_axes: list[Axes], sums: set[int]) -> list[Axes]:
    """The layer axes of a (closed) jaxpr's outputs; adds to ``sums`` the leaves whose
    layers meet in a total sum."""
    jaxpr = open_jaxpr(closed)
    env: dict[Any, Axes] = dict(zip(jaxpr.invars, in_axes, strict=True))
    get = lambda v: {} if isinstance(v, jex_core.Literal) else env.get(v, {})
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [get(v) for v in eqn.invars], sums)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [get(v) for v in jaxpr.outvars]


def _mixed(ins: list[Axes], n_out: int) -> list[Axes]:
    leaves = {i for axes in ins for i in axes}
    return [dict.fromkeys(leaves, MIXED) for _ in range(n_out)]


def _eqn(eqn: Any, ins: list[Axes], sums: set[int]) -> list[Axes]:
    """The layer axes of one equation's outputs."""
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    if not any(ins):
        return [{} for _ in range(n_out)]
    sub = called_jaxpr(eqn)
    if sub is not None and name not in ("scan", "while", "cond"):
        return _run(sub, ins, sums)
    if name == "scan":
        return _scan(eqn, ins, sums)
    if name == "while":
        return _while(eqn, ins, sums)
    if name == "cond":
        if ins[0]:
            return _mixed(ins, n_out)
        branches = [_run(b, ins[1:], sums) for b in eqn.params["branches"]]
        return [_merge(*outs) for outs in zip(*branches, strict=True)]
    if name == "reduce_sum" and len(eqn.params["axes"]) == len(eqn.invars[0].aval.shape):
        total = {i for i, p in ins[0].items() if p is not MIXED}
        sums |= total  # a sum over every layer: whole once summed over the devices
        return [{i: p for i, p in ins[0].items() if i not in total}]
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    rule = _RULES.get(name)
    if name in KEEPS_SHAPE:
        rule = _keeps_shape
    elif name in _REDUCTIONS:
        rule = _reduction
    if rule is None:
        return _mixed(ins, n_out)
    axes: Axes = {}
    for i in {i for a in ins for i in a}:
        where = [(a[i], s, k) for k, (a, s) in enumerate(zip(ins, shapes, strict=True)) if i in a]
        if any(p is MIXED for p, _, _ in where):
            axes[i] = MIXED
        else:
            axes[i] = rule(eqn, where, shapes, out)
    return [axes] + [dict(axes) for _ in range(n_out - 1)]


def _merge(*outs: Axes) -> Axes:
    """One value's layer axes from several sources (branches, loop iterations)."""
    merged: Axes = {}
    for axes in outs:
        for i, p in axes.items():
            merged[i] = p if merged.get(i, p) == p else MIXED
    return merged


def _loop(body: Any, consts: list[Axes], carry: list[Axes], xs: list[Axes], sums) -> list[Axes]:
    """A loop body's outputs once the carry's layer axes are stable."""
    for _ in range(len(carry) + 2):
        outs = _run(body, consts + carry + xs, sums)
        new = [_merge(c, o) for c, o in zip(carry, outs, strict=False)]
        if new == carry:
            return outs
        carry = new
    return _mixed([*consts, *carry, *xs], len(outs))


def _scan(eqn: Any, ins: list[Axes], sums: set[int]) -> list[Axes]:
    n_consts, n_carry = scan_counts(eqn)
    consts, carry = ins[:n_consts], ins[n_consts : n_consts + n_carry]
    xs = ins[n_consts + n_carry :]
    # A slice per iteration: the layer axis one lower, unless it is the scanned axis.
    xs = [{i: MIXED if p in (0, MIXED) else p - 1 for i, p in a.items()} for a in xs]
    outs = _loop(eqn.params["jaxpr"], consts, carry, xs, sums)
    ys = [{i: MIXED if p is MIXED else p + 1 for i, p in a.items()} for a in outs[n_carry:]]
    return outs[:n_carry] + ys


def _while(eqn: Any, ins: list[Axes], sums: set[int]) -> list[Axes]:
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = ins[n_cond + n_body :]
    outs = _loop(eqn.params["body_jaxpr"], ins[n_cond : n_cond + n_body], carry, [], sums)
    merged = [_merge(c, o) for c, o in zip(carry, outs, strict=True)]
    stop = _run(eqn.params["cond_jaxpr"], ins[:n_cond] + merged, set())
    if stop[0]:  # how often it runs depends on the leaf: every layer is involved
        return _mixed(ins, len(outs))
    return outs


# Rules: (eqn, [(axis, operand shape, operand index)] of the operands holding the
# leaf, operand shapes, output shape) -> the output's layer axis.


def _keeps_shape(eqn, where, shapes, out):
    axes = {p for p, s, _ in where if len(s) == len(out)}
    small = [s for _, s, _ in where if len(s) != len(out)]
    return axes.pop() if len(axes) == 1 and not small else MIXED


def _reduction(eqn, where, shapes, out):
    (p, _, _), dims = where[0], eqn.params["axes"]
    return MIXED if p in dims or len(where) > 1 else p - sum(d < p for d in dims)


def _along(param):
    """An operation along one axis (a cumulative sum, a sort, a reverse): mixes layers
    only along the layer axis."""

    def rule(eqn, where, shapes, out):
        dims = eqn.params[param]
        dims = dims if isinstance(dims, tuple | list) else (dims,)
        axes = {p for p, _, _ in where}
        return MIXED if len(axes) > 1 or axes & set(dims) else axes.pop()

    return rule


def _reshape(eqn, where, shapes, out):
    (p, shape, _) = where[0]
    before = math.prod(shape[:p])
    for b, d in enumerate(out):
        if math.prod(out[:b]) == before and d == shape[p]:
            return b
    return MIXED


def _broadcast(eqn, where, shapes, out):
    (p, shape, _) = where[0]
    b = eqn.params["broadcast_dimensions"][p]
    return b if out[b] == shape[p] else MIXED


def _transpose(eqn, where, shapes, out):
    return list(eqn.params["permutation"]).index(where[0][0])


def _whole_axis(eqn, where, shapes, out):
    """Slicing, padding or concatenating: keeps the layer axis if it is left whole."""
    axes = {p for p, _, _ in where}
    p = axes.pop() if len(axes) == 1 else MIXED
    if p is MIXED or any(k != 0 and eqn.primitive.name != "concatenate" for _, _, k in where):
        return MIXED
    if eqn.primitive.name == "concatenate":
        return MIXED if eqn.params["dimension"] == p else p
    return p if out[p] == where[0][1][p] and _untouched(eqn, p) else MIXED


def _untouched(eqn, p):
    params = eqn.params
    if eqn.primitive.name == "pad":
        return tuple(params["padding_config"][p]) == (0, 0, 0)
    if eqn.primitive.name == "slice":
        strides = params.get("strides") or (1,) * len(params["start_indices"])
        return params["start_indices"][p] == 0 and strides[p] == 1
    return True  # dynamic_slice: the slice size along p is the whole axis (checked above)


def _dot_general(eqn, where, shapes, out):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    sides = {k: p for p, _, k in where}
    if sides.get(0) in lc or sides.get(1) in rc:
        return MIXED
    if len(sides) == 2:
        pl, pr = sides[0], sides[1]
        if pl in lb and pr in rb and list(lb).index(pl) == list(rb).index(pr):
            return list(lb).index(pl)
        return MIXED
    k, p = next(iter(sides.items()))
    batch, contract, rank = (lb, lc, len(shapes[0])) if k == 0 else (rb, rc, len(shapes[1]))
    if p in batch:
        return list(batch).index(p)
    free = [d for d in range(rank) if d not in batch and d not in contract]
    lhs_free = len(shapes[0]) - len(lb) - len(lc)
    return len(lb) + (0 if k == 0 else lhs_free) + free.index(p)


_RULES = {
    **dict.fromkeys(["reshape", "squeeze", "expand_dims"], _reshape),
    **dict.fromkeys(["concatenate", "pad", "slice", "dynamic_slice"], _whole_axis),
    **dict.fromkeys(["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"], _along("axis")),
    **{"broadcast_in_dim": _broadcast, "transpose": _transpose, "dot_general": _dot_general},
    **{"sort": _along("dimension"), "rev": _along("dimensions")},
}
