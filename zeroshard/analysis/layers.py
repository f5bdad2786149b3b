"""Layers: which stacked leaves' updates are independent layer by layer.

A leaf of stacked layers (``(L, ...)``, as a scan over layers keeps them) whose update
needs whole tensors may still treat each layer on its own: Muon with the layer axis
as a batch axis orthogonalises each layer's matrix; Adafactor factors each layer's
matrix separately. Such a leaf can be owned layer by layer, its layers spread over
the devices (see :mod:`zeroshard.core.placement`).

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

import jax

from zeroshard.analysis.jaxprs import KEEPS_SHAPE, scan_parts, walk

MIXED = None
"""The position of a leaf's layer axis in a value that mixes its layers."""

Axes = dict[int, int | None]
"""Per candidate leaf a value derives from, where its layer axis is (or ``MIXED``)."""


def independent_layers(
    closed: Any, params: Any, state: Any, state_leaves: tuple, candidates: list[int]
) -> tuple[set[int], set[int]]:
    """The candidate leaves whose traced update is independent layer by layer (its
    update and each state leaf derived from it keep the layer axis first), and of those
    the ones whose layers meet only through sums (a total ``reduce_sum``, as Adafactor's
    update clipping computes an RMS over the whole leaf): owned layer by layer, those
    sums are summed over the devices.

    Args:
      closed: the closed jaxpr of ``inner.update(grads, state, params, **extra)``:
        inputs the gradients, the state leaves, the parameters and the extra
        arguments; outputs the updates, then the new state leaves.
      params, state: the trees it was traced on.
      state_leaves: per state leaf, the parameter leaf it derives from (or ``None``).
      candidates: the stacked leaves to check (one layer axis first).
    """
    if not candidates:
        return set(), set()
    params, state = jax.tree.leaves(params), jax.tree.leaves(state)
    # The layer axes of the inputs: the gradient and the parameter of a candidate at
    # 0, a state leaf derived from one at 0 where it has that many layers first.
    state_axes = [
        {j: 0 if s.shape[:1] == params[j].shape[:1] else MIXED} if j in candidates else {}
        for s, j in zip(state, state_leaves, strict=True)
    ]
    param_axes = [{i: 0} if i in candidates else {} for i in range(len(params))]
    in_axes = param_axes + state_axes + param_axes  # the extra arguments: none
    sums: set[int] = set()
    ok = set(candidates)
    for k, axes in enumerate(_run(closed, in_axes, sums)):
        for i, axis in axes.items():
            # Expected: an update's at 0, a state leaf's where it was.
            if axis is MIXED or axis != (0 if k < len(params) else in_axes[k].get(i, MIXED)):
                ok.discard(i)
    return ok, sums & ok


def _run(closed: Any, in_axes: list[Axes], sums: set[int]) -> list[Axes]:
    """The layer axes of a (closed) jaxpr's outputs; adds to ``sums`` the leaves whose
    layers meet in a total sum."""
    return walk(closed, in_axes, lambda eqn, ins: _eqn(eqn, ins, sums), {})


def _mixed(ins: list[Axes], n_out: int) -> list[Axes]:
    leaves = {i for axes in ins for i in axes}
    return [dict.fromkeys(leaves, MIXED) for _ in range(n_out)]


def _eqn(eqn: Any, ins: list[Axes], sums: set[int]) -> list[Axes]:
    """The layer axes of one equation's outputs."""
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    if not any(ins):
        return [{} for _ in range(n_out)]
    if name in _LOOPS:
        return _LOOPS[name](eqn, ins, sums)
    if name == "cond":
        if ins[0]:
            return _mixed(ins, n_out)
        branches = [_run(b, ins[1:], sums) for b in eqn.params["branches"]]
        return [_merge(*outs) for outs in zip(*branches, strict=True)]
    if name == "reduce_sum" and len(eqn.params["axes"]) == len(eqn.invars[0].aval.shape):
        # A sum over every layer: whole once summed over the devices.
        sums |= {i for i, p in ins[0].items() if p is not MIXED}
        return [{i: p for i, p in ins[0].items() if p is MIXED}]
    rule = _RULES.get(name)
    if rule is None:
        return _mixed(ins, n_out)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out = tuple(eqn.outvars[0].aval.shape)
    axes: Axes = {}
    for i in {i for a in ins for i in a}:
        where = [(a[i], s, k) for k, (a, s) in enumerate(zip(ins, shapes, strict=True)) if i in a]
        axes[i] = MIXED if any(p is MIXED for p, _, _ in where) else rule(eqn, where, shapes, out)
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
    consts, carry, xs = scan_parts(eqn, ins)
    # A slice per iteration: the layer axis one lower, unless it is the scanned axis.
    xs = [{i: MIXED if p in (0, MIXED) else p - 1 for i, p in a.items()} for a in xs]
    outs = _loop(eqn.params["jaxpr"], consts, carry, xs, sums)
    n = len(carry)
    return outs[:n] + [{i: MIXED if p is MIXED else p + 1 for i, p in a.items()} for a in outs[n:]]


def _while(eqn: Any, ins: list[Axes], sums: set[int]) -> list[Axes]:
    n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = ins[n_cond + n_body :]
    outs = _loop(eqn.params["body_jaxpr"], ins[n_cond : n_cond + n_body], carry, [], sums)
    merged = [_merge(c, o) for c, o in zip(carry, outs, strict=True)]
    stop = _run(eqn.params["cond_jaxpr"], ins[:n_cond] + merged, set())
    # How often it runs depends on the leaf: every layer is involved.
    return _mixed(ins, len(outs)) if stop[0] else outs


_LOOPS = {"scan": _scan, "while": _while}


# Rules: (eqn, [(axis, operand shape, operand index)] of the operands holding the
# leaf, operand shapes, output shape) -> the output's layer axis.


def _keeps_shape(eqn, where, shapes, out):
    axes = {p if len(s) == len(out) else MIXED for p, s, _ in where}
    return axes.pop() if len(axes) == 1 else MIXED


def _reduction(eqn, where, shapes, out):
    (p, _, _), dims = where[0], eqn.params["axes"]
    return MIXED if p in dims or len(where) > 1 else p - sum(d < p for d in dims)


def _along(param):
    """An operation along one axis (a cumulative sum, a sort, a reverse, a
    concatenation): mixes layers only along the layer axis."""

    def rule(eqn, where, shapes, out):
        dims = eqn.params[param]
        dims = dims if isinstance(dims, tuple | list) else (dims,)
        axes = {p for p, _, _ in where}
        return MIXED if len(axes) > 1 or axes & set(dims) else axes.pop()

    return rule


def _reshape(eqn, where, shapes, out):
    (p, shape, _) = where[0]
    before = math.prod(shape[:p])
    moved = (b for b, d in enumerate(out) if math.prod(out[:b]) == before and d == shape[p])
    return next(moved, MIXED)


def _broadcast(eqn, where, shapes, out):
    (p, shape, _) = where[0]
    b = eqn.params["broadcast_dimensions"][p]
    return b if out[b] == shape[p] else MIXED


def _transpose(eqn, where, shapes, out):
    return list(eqn.params["permutation"]).index(where[0][0])


def _whole_axis(eqn, where, shapes, out):
    """Slicing or padding: keeps the layer axis if it is left whole."""
    (p, shape, _), params = where[0], eqn.params
    if [k for _, _, k in where] != [0] or out[p] != shape[p]:
        return MIXED
    if eqn.primitive.name == "pad":
        return p if tuple(params["padding_config"][p]) == (0, 0, 0) else MIXED
    if eqn.primitive.name == "slice":
        strides = params.get("strides") or (1,) * len(params["start_indices"])
        return p if params["start_indices"][p] == 0 and strides[p] == 1 else MIXED
    return p  # dynamic_slice: the slice size along p is the whole axis (checked above)


def _dot_general(eqn, where, shapes, out):
    """A contraction: the output holds the batch axes, then the left side's free axes,
    then the right side's; the layer axis must be the same batch axis on both sides."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_free = len(shapes[0]) - len(lb) - len(lc)
    axes = set()
    for p, shape, k in where:
        batch, contract = (lb, lc) if k == 0 else (rb, rc)
        if p in contract:
            return MIXED
        free = [d for d in range(len(shape)) if d not in batch and d not in contract]
        axes.add(list(batch).index(p) if p in batch else len(lb) + lhs_free * k + free.index(p))
    return axes.pop() if len(axes) == 1 else MIXED


_RULES = {
    **dict.fromkeys(KEEPS_SHAPE, _keeps_shape),
    **dict.fromkeys(["reduce_sum", "reduce_max", "reduce_min", "reduce_prod"], _reduction),
    **dict.fromkeys(["reduce_and", "reduce_or", "argmax", "argmin"], _reduction),
    **dict.fromkeys(["reshape", "squeeze", "expand_dims"], _reshape),
    **dict.fromkeys(["pad", "slice", "dynamic_slice"], _whole_axis),
    **dict.fromkeys(["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"], _along("axis")),
    **{"broadcast_in_dim": _broadcast, "transpose": _transpose, "dot_general": _dot_general},
    **dict.fromkeys(["concatenate", "sort"], _along("dimension")),
    "rev": _along("dimensions"),
}
