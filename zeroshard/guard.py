"""Guard: which leaves the inner optimizer may update as slices, and which need whole tensors.

Running an optimizer on a slice of a leaf gives the same numbers as running it on the
full leaf only if each output element depends on the same element of the gradients
and weights (plus scalars such as the step count). A per-tensor norm (LAMB, LARS),
a factored second moment (Adafactor) or a matrix function (Muon's Newton-Schulz)
mixes the elements of one leaf: such a leaf is *owned*, placed whole on one device
(see :mod:`zeroshard.layout`). Mixing the elements of several leaves (e.g.
``optax.clip_by_global_norm``) cannot be made exact by placement and is refused. All
of this is read from the traced computation (the jaxpr), not from a list of names.

Every value in the jaxpr carries a tag: a kind and the set of parameter leaves it
derives from. Kinds are ``CLEAN`` (no per-element data), ``ELEM`` (one value per
element of its leaves), ``PARTIAL`` (a sum over this device's elements, not yet
summed over the axis) and ``WHOLE`` (computed from a whole leaf: exact only on the
leaf's owner). A total ``reduce_sum`` turns ``ELEM`` into ``PARTIAL`` and ``psum`` over the
sharded axis turns ``PARTIAL`` back into ``CLEAN``: that is how
:func:`zeroshard.clip_by_global_norm` is exact while ``optax.clip_by_global_norm`` is
refused. Any other mixing makes its one leaf ``WHOLE`` (or is refused across leaves).

A second check compares, leaf by leaf, the operations traced on full leaves with
those traced on slices: a leaf whose update depends on its shape (e.g. factored only
when large, or masked by shape) is owned too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax
from jax.extend import core as jex_core

from zeroshard.layout import PyTree

CLEAN, ELEM, PARTIAL, WHOLE = 0, 1, 2, 3
_NONE: frozenset[int] = frozenset()

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

Tag = tuple[int, frozenset]
_CLEAN: Tag = (CLEAN, _NONE)


class NotElementwiseError(ValueError):
    """The inner optimizer mixes parameters in a way no placement makes exact."""


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the traced inner update needs, per leaf.

    Attributes:
      whole: the leaves whose update needs the whole tensor (to be owned).
      matrix: of those, the leaves whose whole-tensor work is matrix products (their
        cost grows as ``m * n * min(m, n)``, as Newton-Schulz does).
      state_leaves: per leaf of the inner state, the parameter leaf it derives from
        in the update, or ``None`` (counts, hyperparameters, leaves never updated).
    """

    whole: frozenset[int]
    matrix: frozenset[int]
    state_leaves: tuple[int | None, ...]


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


def _primitives(jaxpr: Any) -> list[str]:
    """The computation's primitives in order, recursively, less pure reshapes."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _RESHAPING:
            names.append(eqn.primitive.name)
        for p in eqn.params.values():
            for s in p if isinstance(p, tuple) else (p,):
                sub = _as_jaxpr(s)
                if sub is not None:
                    names += _primitives(sub)
    return names


class _Tagger:
    """Propagates tags through a jaxpr, collecting the leaves that need whole tensors
    and, per leaf, the primitives applied to its data."""

    def __init__(self, axis_name: str, leaf_names: list[str]):
        self.axis_name, self.leaf_names = axis_name, leaf_names
        self.whole: set[int] = set()
        self.matrix: set[int] = set()
        self.ops: dict[int, list[str]] = defaultdict(list)

    def _own(self, eqn: Any, leaves: frozenset, why: str) -> Tag:
        """``leaves`` need their whole tensors: refused unless that is one leaf."""
        if len(leaves) > 1:
            names = ", ".join(self.leaf_names[i] for i in sorted(leaves)[:4])
            _refuse(eqn, f"{why} across several parameters ({names}, ...)")
        self.whole |= leaves
        if eqn.primitive.name == "dot_general" or (
            (sub := _sub_jaxpr(eqn) or _as_jaxpr(eqn.params.get("body_jaxpr")))
            and "dot_general" in _primitives(sub)
        ):
            self.matrix |= leaves
        return (WHOLE, leaves)

    def run(self, jaxpr: Any, in_tags: list[Tag]) -> list[Tag]:
        tags: dict[Any, Tag] = {}
        read = lambda v: tags.get(v, _CLEAN) if isinstance(v, jex_core.Var) else _CLEAN
        for v, t in zip(jaxpr.invars, in_tags, strict=True):
            tags[v] = t
        for eqn in jaxpr.eqns:
            outs = self._eqn(eqn, [read(v) for v in eqn.invars])
            for v, t in zip(eqn.outvars, outs, strict=True):
                tags[v] = t
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list[Tag]) -> list[Tag]:
        name = eqn.primitive.name
        kinds = {k for k, _ in ins}
        leaves = frozenset().union(*(s for _, s in ins))
        n_out = len(eqn.outvars)
        if name not in _RESHAPING:
            for i in leaves:
                self.ops[i].append(name)
        sub = _sub_jaxpr(eqn)
        if name == "cond":
            branches = [self.run(_as_jaxpr(b), ins[1:]) for b in eqn.params["branches"]]
            if ins[0] != _CLEAN:
                return [self._own(eqn, leaves, "branches on per-element data")] * n_out
            return [
                (max(k for k, _ in ts), frozenset().union(*(s for _, s in ts)))
                for ts in zip(*branches, strict=True)
            ]
        if sub is not None and name not in ("scan", "while"):
            return self.run(sub, ins)
        if kinds <= {CLEAN}:
            return [_CLEAN] * n_out
        if name.startswith("psum") and self.axis_name in eqn.params.get("axes", ()):
            if kinds & {ELEM, WHOLE}:
                _refuse(eqn, "sums per-element or whole-tensor values across devices")
            return [_CLEAN] * n_out
        if WHOLE in kinds:
            return [self._own(eqn, leaves, "combines a whole-tensor value")] * n_out
        if PARTIAL in kinds:
            if ELEM in kinds:
                return [
                    self._own(eqn, leaves, "mixes a partial sum with per-element values")
                ] * n_out
            clean_others = sum(k != CLEAN for k, _ in ins) == 1
            linear = name in _LINEAR and (clean_others or name in ("add", "sub"))
            if (
                name in ("reduce_sum", "concatenate")
                or name in _RESHAPING
                or (linear and not (name == "div" and ins[1][0] != CLEAN))
            ):
                return [(PARTIAL, leaves)] * n_out
            why = "uses a sum over this device's elements only (a norm without a psum)"
            return [self._own(eqn, leaves, why)] * n_out
        if name == "reduce_sum" and eqn.outvars[0].aval.size == 1:
            return [(PARTIAL, leaves)]
        if name in _ELEMENTWISE or name in _PASS_THROUGH:
            return [(ELEM, leaves)] * n_out
        if name in _RESHAPING and eqn.invars[0].aval.size == eqn.outvars[0].aval.size:
            return [(ELEM, leaves)]
        why = "mixes elements (a reduction, matmul, slice or reorder)"
        return [self._own(eqn, leaves, why)] * n_out


def _trace(inner: Any, params: PyTree, state: PyTree, axis_name: str, num_shards: int, extra):
    fn = lambda u, s, p: inner.update(u, s, p, **extra)
    return jax.make_jaxpr(fn, axis_env=[(axis_name, num_shards)])(params, state, params).jaxpr


def analyze(
    inner: Any,
    full_params: PyTree,
    full_state: PyTree,
    piece_params: PyTree,
    piece_state: PyTree,
    axis_name: str,
    num_shards: int,
    extra_args: dict[str, Any] | None = None,
) -> Analysis:
    """Finds the leaves whose inner update needs the whole tensor.

    Args:
      inner: the optax transformation to run on this device's part of the parameters.
      full_params: ``ShapeDtypeStruct`` tree of the full parameters (master dtype).
      full_state: ``jax.eval_shape(inner.init, full_params)``.
      piece_params: the same tree with this device's slices.
      piece_state: ``jax.eval_shape(inner.init, piece_params)``.
      axis_name: the sharded mesh axis.
      num_shards: its size.
      extra_args: ``ShapeDtypeStruct``s of the inner update's extra arguments.

    Raises:
      NotElementwiseError: where the update mixes several leaves without a psum over
        ``axis_name`` (no placement makes that exact).
    """
    extra = extra_args or {}
    path_leaves = jax.tree_util.tree_flatten_with_path(full_params)[0]
    names = [jax.tree_util.keystr(p) for p, _ in path_leaves]
    n_params, n_state = len(names), len(jax.tree.leaves(full_state))
    fix = (
        "Mixing several parameters needs a sum over the sharded axis: use "
        "zs.clip_by_global_norm(max_norm, axis_name=...) instead of optax.clip_by_global_norm."
    )
    params_in = [(ELEM, frozenset([i])) for i in range(n_params)]
    extra_in = [_CLEAN] * len(jax.tree.leaves(extra))

    def tag(jaxpr: Any, state_in: list[Tag]) -> tuple[_Tagger, list[Tag]]:
        tagger = _Tagger(axis_name, names)
        return tagger, tagger.run(jaxpr, params_in + state_in + params_in + extra_in)

    full = _trace(inner, full_params, full_state, axis_name, num_shards, extra)
    try:
        # A second pass gives the state the tags the first pass computed for it.
        state_in = tag(full, [_CLEAN] * n_state)[1][n_params:]
        tagger, outs = tag(full, state_in)
    except NotElementwiseError as e:
        raise NotElementwiseError(
            f"zs.sharded cannot run this inner optimizer exactly on any placement of the "
            f"parameters over {num_shards} devices: {e}. {fix}"
        ) from None
    for i, (kind, leaves) in enumerate(outs[:n_params]):
        if kind == PARTIAL or not leaves <= {i}:
            why = (
                "a sum over this device's slice that is never summed across the axis"
                if kind == PARTIAL
                else "other parameters: " + ", ".join(names[j] for j in sorted(leaves - {i}))
            )
            raise NotElementwiseError(
                f"zs.sharded: the update of {names[i]} depends on {why}. {fix}"
            )
    state_leaves = []
    state_paths = jax.tree_util.tree_flatten_with_path(full_state)[0]
    for (path, _), (kind, leaves) in zip(state_paths, outs[n_params:], strict=True):
        if kind == PARTIAL or len(leaves) > 1:
            raise NotElementwiseError(
                f"zs.sharded: inner state leaf {jax.tree_util.keystr(path)} depends on several "
                f"parameters, or on a sum that is never summed across the axis. {fix}"
            )
        state_leaves.append(min(leaves, default=None))
    whole = set(tagger.whole)
    try:  # leaf by leaf: does the update do on a slice what it does on the full leaf?
        pieces = _trace(inner, piece_params, piece_state, axis_name, num_shards, extra)
        sliced = tag(pieces, state_in)[0]
        whole |= {i for i in range(n_params) if sliced.ops[i] != tagger.ops[i]}
    except NotElementwiseError:
        whole = set(range(n_params))
    return Analysis(frozenset(whole), frozenset(tagger.matrix), tuple(state_leaves))
