"""Analysis: which leaves the inner optimizer may update as slices, and which need whole tensors.

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
import re
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from zeroshard.layout import PyTree

CLEAN, GENERATED, ELEM, PARTIAL, WHOLE = 0, 1, 2, 3, 4
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
# Make values at a given shape from no per-element data: on a slice they would differ.
_GENERATORS = frozenset(["random_bits", "threefry2x32", "rng_bit_generator", "iota"])

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
      state_tags: the inner state's tags, as the update reads them.
      sums: whether partial sums over several leaves meet a non-linear operation
        (a global norm): the update then runs with :func:`zeroshard.sums.run_with_sums`.
    """

    whole: frozenset[int]
    matrix: frozenset[int]
    state_leaves: tuple[int | None, ...]
    state_tags: tuple[Tag, ...] = ()
    sums: bool = False

    def in_tags(self, num_params: int) -> list[Tag]:
        """Tags of the update's inputs: gradients, state, parameters (extra arguments
        are clean)."""
        params = [(ELEM, frozenset([i])) for i in range(num_params)]
        return params + list(self.state_tags) + params


def _as_jaxpr(x: Any) -> Any:
    """The open jaxpr of a ``Jaxpr`` or ``ClosedJaxpr`` (whose classes vary by jax version)."""
    inner = getattr(x, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return inner
    return x if hasattr(x, "eqns") and hasattr(x, "invars") else None


def _sub_closed(eqn: Any) -> Any:
    """The (closed, where it has constants) jaxpr an equation calls, if any."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if _as_jaxpr(sub) is not None:
            return sub
    return None


def _sub_jaxpr(eqn: Any) -> Any:
    sub = _sub_closed(eqn)
    return None if sub is None else _as_jaxpr(sub)


def _where(eqn: Any) -> str:
    frame = eqn.source_info.traceback
    if frame is None:
        return ""
    for f in frame.frames:
        if (
            "/jax/" not in f.file_name
            and "zeroshard/analysis" not in f.file_name
            and "zeroshard/sums" not in f.file_name
        ):
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


class Tagger:
    """Propagates tags through a jaxpr, collecting the leaves that need whole tensors
    and, per leaf, the primitives applied to its data.

    Where several leaves' partial sums meet a non-linear operation (a global norm, as
    in ``optax.clip_by_global_norm``), the partial sums are summed over the axis
    first: ``sums`` records that. Given ``values``, :meth:`run` also evaluates the
    jaxpr on them, with those sums inserted (:func:`zeroshard.sums.run_with_sums`).
    """

    def __init__(self, axis_name: str, leaf_names: list[str]):
        self.axis_name, self.leaf_names = axis_name, leaf_names
        self.whole: set[int] = set()
        self.matrix: set[int] = set()
        self.ops: dict[int, list[str]] = defaultdict(list)
        self.sums = False
        self._in_branch = 0

    def _own(self, eqn: Any, leaves: frozenset, why: str) -> Tag:
        """``leaves`` need their whole tensors: refused unless that is one leaf."""
        if len(leaves) > 1:
            names = ", ".join(self.leaf_names[i] for i in sorted(leaves)[:4])
            _refuse(eqn, f"{why} across several parameters ({names}{', ...' * (len(leaves) > 4)})")
        self.whole |= leaves
        if eqn.primitive.name == "dot_general" or (
            (sub := _sub_jaxpr(eqn) or _as_jaxpr(eqn.params.get("body_jaxpr")))
            and "dot_general" in _primitives(sub)
        ):
            self.matrix |= leaves
        return (WHOLE, leaves)

    def run(self, jaxpr: Any, in_tags: list[Tag], values: list | None = None) -> tuple[list, list]:
        """Output tags (and values, given input ``values``) of a (closed) jaxpr."""
        consts = getattr(jaxpr, "consts", ())
        jaxpr = _as_jaxpr(jaxpr)
        tags: dict[Any, Tag] = {}
        vals: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=False))
        tag = lambda v: tags.get(v, _CLEAN) if isinstance(v, jex_core.Var) else _CLEAN
        val = lambda v: vals[v] if isinstance(v, jex_core.Var) else v.val
        for k, (v, t) in enumerate(zip(jaxpr.invars, in_tags, strict=True)):
            tags[v] = t
            if values is not None:
                vals[v] = values[k]
        for eqn in jaxpr.eqns:
            xs = None if values is None else [val(v) for v in eqn.invars]
            outs, ys = self._eqn(eqn, [tag(v) for v in eqn.invars], xs)
            for k, (v, t) in enumerate(zip(eqn.outvars, outs, strict=True)):
                tags[v] = t
                if values is not None:
                    vals[v] = ys[k]
        outs = [tag(v) for v in jaxpr.outvars]
        return outs, None if values is None else [val(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, ins: list[Tag], xs: list | None) -> tuple[list[Tag], list | None]:
        name = eqn.primitive.name
        sub = _sub_closed(eqn)
        if sub is not None and name not in ("scan", "while", "cond"):
            return self.run(sub, ins, xs)  # calls are inlined
        outs = self._tags(eqn, ins)
        if outs is None:  # several leaves' partial sums: sum them over the axis first
            self.sums = True
            summed = [k for k, (kind, _) in enumerate(ins) if kind == PARTIAL]
            ins = [_CLEAN if k in summed else t for k, t in enumerate(ins)]
            if xs is not None:  # still typed varying, as the jaxpr was traced
                total = lambda x: jax.lax.pcast(
                    jax.lax.psum(x, self.axis_name), self.axis_name, to="varying"
                )
                xs = [total(x) if k in summed else x for k, x in enumerate(xs)]
            outs = self._tags(eqn, ins)
        if xs is None:
            return outs, None
        params = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = params if isinstance(params, tuple) else ((), params)  # older jax
        ys = eqn.primitive.bind(*subfuns, *xs, **params)
        return outs, ys if eqn.primitive.multiple_results else [ys]

    def _tags(self, eqn: Any, ins: list[Tag]) -> list[Tag] | None:
        """The output tags of ``eqn``, or ``None`` where several leaves' partial sums
        must first be summed over the axis."""
        name = eqn.primitive.name
        kinds = {k for k, _ in ins}
        leaves = frozenset().union(*(s for _, s in ins))
        n_out = len(eqn.outvars)
        if name not in _RESHAPING:
            for i in leaves:
                self.ops[i].append(name)
        if name == "cond":
            self._in_branch += 1
            branches = [self.run(b, ins[1:])[0] for b in eqn.params["branches"]]
            self._in_branch -= 1
            if ins[0] != _CLEAN:
                return [self._own(eqn, leaves, "branches on per-element data")] * n_out
            return [
                (max(k for k, _ in ts), frozenset().union(*(s for _, s in ts)))
                for ts in zip(*branches, strict=True)
            ]
        if kinds <= {CLEAN, GENERATED}:
            generated = GENERATED in kinds or name in _GENERATORS
            big = generated and any(v.aval.size > 1 for v in eqn.outvars)
            return [(GENERATED, _NONE) if big else _CLEAN] * n_out
        if name.startswith("psum") and self.axis_name in eqn.params.get("axes", ()):
            if kinds & {ELEM, WHOLE}:
                _refuse(eqn, "sums per-element or whole-tensor values across devices")
            return [_CLEAN] * n_out
        if GENERATED in kinds:
            why = "combines values generated at the leaf's shape (random numbers, iota)"
            return [self._own(eqn, leaves, why)] * n_out
        if WHOLE in kinds:
            return [self._own(eqn, leaves, "combines a whole-tensor value")] * n_out
        if PARTIAL in kinds:
            clean_others = sum(k != CLEAN for k, _ in ins) == 1
            linear = name in _LINEAR and (clean_others or name in ("add", "sub"))
            if ELEM not in kinds and (
                name in ("reduce_sum", "concatenate")
                or name in _RESHAPING
                or (linear and not (name == "div" and ins[1][0] != CLEAN))
            ):
                return [(PARTIAL, leaves)] * n_out
            partial = frozenset().union(*(s for k, s in ins if k == PARTIAL))
            if len(partial) > 1 and not self._in_branch:
                return None
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
    """The closed jaxpr of ``inner.update``, and the extra arguments it was traced with:
    ``extra`` plus a float32 scalar for each keyword argument the update requires that
    ``extra`` lacks (e.g. the ``value=`` of ``optax.polyak_sgd``)."""
    extra = dict(extra)
    fn = lambda u, s, p, e: inner.update(u, s, p, **e)
    while True:
        try:
            jaxpr = jax.make_jaxpr(fn, axis_env=[(axis_name, num_shards)])
            return jaxpr(params, state, params, extra), extra
        except TypeError as e:
            missing = re.search(r"required keyword-only argument: '(\w+)'", str(e))
            if missing is None or missing.group(1) in extra:
                raise
            extra[missing.group(1)] = jax.ShapeDtypeStruct((), jnp.float32)


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
      extra_args: ``ShapeDtypeStruct``s of the inner update's extra arguments (those
        it requires and is not given are traced as float32 scalars).

    Raises:
      NotElementwiseError: where the update mixes several leaves without a psum over
        ``axis_name`` (no placement makes that exact).
    """
    path_leaves = jax.tree_util.tree_flatten_with_path(full_params)[0]
    names = [jax.tree_util.keystr(p) for p, _ in path_leaves]
    n_params, n_state = len(names), len(jax.tree.leaves(full_state))
    fix = (
        "zeroshard runs an update exactly when it treats leaves separately or combines them "
        "through sums (as a global norm does); non-finite steps are skipped by zs.sharded "
        "itself (skip_nonfinite=True), with no optax.apply_if_finite."
    )
    params_in = [(ELEM, frozenset([i])) for i in range(n_params)]
    full, extra = _trace(inner, full_params, full_state, axis_name, num_shards, extra_args or {})
    extra_in = [_CLEAN] * len(jax.tree.leaves(extra))

    def tag(jaxpr: Any, state_in: list[Tag]) -> tuple[Tagger, list[Tag]]:
        tagger = Tagger(axis_name, names)
        return tagger, tagger.run(jaxpr, params_in + state_in + params_in + extra_in)[0]

    try:
        # A second pass gives the state the tags the first pass computed for it.
        state_in = tag(full, [_CLEAN] * n_state)[1][n_params:]
        tagger, outs = tag(full, state_in)
    except NotElementwiseError as e:
        raise NotElementwiseError(
            f"zs.sharded cannot run this inner optimizer exactly on any placement of the "
            f"parameters over {num_shards} devices: {e}. {fix}"
        ) from None
    state_leaves = _state_leaves(outs, names, full_state, fix)
    whole = set(tagger.whole)
    try:  # leaf by leaf: does the update do on a slice what it does on the full leaf?
        pieces = _trace(inner, piece_params, piece_state, axis_name, num_shards, extra)[0]
        sliced = tag(pieces, state_in)[0]
        whole |= {i for i in range(n_params) if sliced.ops[i] != tagger.ops[i]}
    except NotElementwiseError:
        whole = set(range(n_params))
    return Analysis(
        frozenset(whole),
        frozenset(tagger.matrix),
        state_leaves,
        tuple(state_in),
        tagger.sums,
    )


def _state_leaves(
    outs: list[Tag], names: list[str], full_state: PyTree, fix: str
) -> tuple[int | None, ...]:
    """Checks the tags of the update's outputs (each parameter's update from itself
    alone, each state leaf from at most one parameter, no sum left partial) and
    returns, per state leaf, the parameter it derives from (or ``None``).

    Raises:
      NotElementwiseError: naming the first output that breaks one of these.
    """
    n_params = len(names)
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
    return tuple(state_leaves)
