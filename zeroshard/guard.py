"""Guard: refuse inner optimizers whose update is not elementwise over parameters.

Running an optimizer on a slice of every leaf gives the same numbers as running it
on the full leaves only if each output element depends on the same element of the
gradients and weights (plus scalars such as the step count). A global-norm clip,
LAMB's trust ratio, factored second moments or Muon's orthogonalisation mix
elements and would silently train differently; this module finds that out from
the traced computation (the jaxpr), not from a list of names.

Values in the jaxpr carry one of three tags: ``CLEAN`` (does not depend on
per-element data), ``ELEM`` (one value per parameter element) and ``PARTIAL`` (a sum
over this device's elements, not yet summed over the axis). ``reduce_sum`` turns
``ELEM`` into ``PARTIAL`` and ``psum`` over the sharded axis turns ``PARTIAL`` back
into ``CLEAN``: that is how :func:`zeroshard.clip_by_global_norm` is accepted while
``optax.clip_by_global_norm`` is refused. Any other mixing of elements is refused.

A second check compares the computation traced on full leaves with the one traced
on this device's pieces: if they differ, the inner transform branches on leaf
shapes (e.g. factors only large matrices, or masks by shape) and is refused too.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jex_core

from zeroshard.layout import PyTree

CLEAN, ELEM, PARTIAL = 0, 1, 2

_ELEMENTWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz conj complex
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2
    expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or population_count pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    """.split()
)
# Linear in a PARTIAL operand when every other operand is CLEAN.
_LINEAR = frozenset("add sub neg convert_element_type copy copy_p mul div select_n".split())
_RESHAPING = frozenset(["reshape", "squeeze", "expand_dims", "broadcast_in_dim"])
_PASS_THROUGH = frozenset(["sharding_constraint", "pvary", "pcast", "optimization_barrier"])


class NotElementwiseError(ValueError):
    """The inner optimizer mixes parameter elements; sharding it would change results."""


def _as_jaxpr(x: Any) -> Any:
    """The open jaxpr of a ``Jaxpr`` or ``ClosedJaxpr`` (whose classes vary by jax version)."""
    inner = getattr(x, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return inner
    return x if hasattr(x, "eqns") and hasattr(x, "invars") else None


def _sub_jaxpr(eqn: Any) -> Any:
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = _as_jaxpr(eqn.params.get(name))
        if sub is not None:
            return sub
    return None


def _where(eqn: Any) -> str:
    frame = eqn.source_info.traceback
    if frame is None:
        return ""
    for f in frame.frames:
        if "/jax/" not in f.file_name and "zeroshard/guard" not in f.file_name:
            return f" (at {f.file_name}:{getattr(f, 'line_num', '?')})"
    return ""


def _refuse(eqn: Any, why: str) -> None:
    raise NotElementwiseError(f"`{eqn.primitive.name}` {why}{_where(eqn)}")


def _tag_jaxpr(jaxpr: Any, in_tags: list[int], axis_name: str) -> list[int]:
    """Propagates tags through ``jaxpr``; raises on the first element-mixing op."""
    tags: dict[Any, int] = {}

    def read(v: Any) -> int:
        return tags.get(v, CLEAN) if isinstance(v, jex_core.Var) else CLEAN

    for v, t in zip(jaxpr.invars, in_tags, strict=True):
        tags[v] = t
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        top = max(ins, default=CLEAN)
        sub = _sub_jaxpr(eqn)
        if name == "cond":
            if ins[0] != CLEAN:
                _refuse(eqn, "branches on per-element data")
            outs = [
                max(ts)
                for ts in zip(
                    *(_tag_jaxpr(_as_jaxpr(b), ins[1:], axis_name) for b in eqn.params["branches"]),
                    strict=True,
                )
            ]
        elif sub is not None and name not in ("scan", "while"):
            outs = _tag_jaxpr(sub, ins, axis_name)
        elif top == CLEAN:
            outs = [CLEAN] * len(eqn.outvars)
        elif name.startswith("psum") and axis_name in eqn.params.get("axes", ()):
            if ELEM in ins:
                _refuse(eqn, "sums per-element values across devices")
            outs = [CLEAN] * len(eqn.outvars)
        elif PARTIAL in ins:
            if ELEM in ins:
                _refuse(eqn, "mixes a per-device partial sum with per-element values")
            clean_others = sum(t != CLEAN for t in ins) == 1
            if name in ("reduce_sum", "concatenate") or name in _RESHAPING:
                outs = [PARTIAL] * len(eqn.outvars)
            elif name in _LINEAR and (clean_others or name in ("add", "sub")):
                if name == "div" and ins[1] != CLEAN:
                    _refuse(eqn, "divides by a partial sum that was never summed across devices")
                outs = [PARTIAL] * len(eqn.outvars)
            else:
                _refuse(
                    eqn,
                    "is applied to a sum over this device's slice only (a global reduction "
                    "without a psum across the sharded axis, e.g. a global norm)",
                )
        elif name == "reduce_sum":
            outs = [PARTIAL]
        elif name in _ELEMENTWISE or name in _PASS_THROUGH:
            outs = [ELEM] * len(eqn.outvars)
        elif name in _RESHAPING:
            aval_in, aval_out = eqn.invars[0].aval, eqn.outvars[0].aval
            if aval_in.size != aval_out.size:
                _refuse(eqn, "broadcasts per-element values to a different size")
            outs = [ELEM]
        else:
            _refuse(eqn, "mixes elements of a parameter (a reduction, matmul, slice or reorder)")
        for v, t in zip(eqn.outvars, outs, strict=True):
            tags[v] = t
    return [read(v) for v in jaxpr.outvars]


def _primitives(jaxpr: Any) -> list[str]:
    """The computation's primitives in order, recursively, less pure reshapes (a scalar
    leaf is ``()`` in full but ``(1,)`` as a piece)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _RESHAPING:
            names.append(eqn.primitive.name)
        for p in eqn.params.values():
            subs = p if isinstance(p, tuple) else (p,)
            for s in subs:
                sub = _as_jaxpr(s)
                if sub is not None:
                    names += _primitives(sub)
    return names


def _trace(inner: Any, params: PyTree, state: PyTree, axis_name: str, num_shards: int):
    fn = lambda u, s, p: inner.update(u, s, p)
    return jax.make_jaxpr(fn, axis_env=[(axis_name, num_shards)])(params, state, params).jaxpr


def check_elementwise(
    inner: Any,
    full_params: PyTree,
    full_state: PyTree,
    piece_params: PyTree,
    piece_state: PyTree,
    axis_name: str,
    num_shards: int,
) -> None:
    """Raises ``ValueError`` unless ``inner.update`` is elementwise over parameters.

    Args:
      inner: the optax transformation to be run on slices.
      full_params: ``ShapeDtypeStruct`` tree of the full parameters (master dtype).
      full_state: ``jax.eval_shape(inner.init, full_params)``.
      piece_params: the same tree with this device's pieces.
      piece_state: ``jax.eval_shape(inner.init, piece_params)``.
      axis_name: the sharded mesh axis.
      num_shards: its size.
    """
    full = _trace(inner, full_params, full_state, axis_name, num_shards)
    n_updates = len(jax.tree.leaves(full_params))
    n_state = len(jax.tree.leaves(full_state))
    in_tags = [ELEM] * n_updates + [CLEAN] * n_state + [ELEM] * n_updates
    fix = (
        "Use an elementwise optimizer (sgd, adam, adamw, lion, adagrad, rmsprop, ...) inside "
        "zs.sharded, and zs.clip_by_global_norm(max_norm, axis_name=...) instead of "
        "optax.clip_by_global_norm."
    )
    try:
        out_tags = _tag_jaxpr(full, in_tags, axis_name)
    except NotElementwiseError as e:
        raise NotElementwiseError(
            f"zs.sharded cannot run this inner optimizer on 1/{num_shards} slices: its update "
            f"is not elementwise over the parameters: {e}. Run on a slice it would silently "
            f"compute different numbers. {fix}"
        ) from None
    if PARTIAL in out_tags:
        raise NotElementwiseError(
            "zs.sharded: the inner optimizer returns a sum over this device's slice that is "
            f"never summed across axis {axis_name!r}. {fix}"
        )
    if _primitives(full) != _primitives(
        _trace(inner, piece_params, piece_state, axis_name, num_shards)
    ):
        raise NotElementwiseError(
            "zs.sharded: the inner optimizer computes something different on a slice than on "
            "the full parameters: it depends on the leaves' shapes (for example a factored "
            "second moment for large matrices, or a mask computed from shapes). Give masks "
            f"as trees computed from the full parameters. {fix}"
        )
