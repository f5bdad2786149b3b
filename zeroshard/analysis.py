"""Analysis: which leaves the inner optimizer may update as slices, and which need whole tensors.

Running an optimizer on a slice of a leaf gives the same numbers as running it on the
full leaf if each output element depends on the same element of the gradients and
weights, plus scalars such as the step count and *sums* over elements: a per-tensor
norm (LAMB's and LARS's trust ratios), an RMS or a mean (Adafactor's update clipping),
a global norm over several leaves (``optax.clip_by_global_norm``). A sum over this
device's piece is partial; summed over the devices (padding left out, a mean divided
by the whole leaf's size) it is the sum over the leaf, and the slice's update is
exact. A factored second moment (Adafactor's row and column means), a matrix function
(Muon's Newton-Schulz) or a shape-dependent rule mixes the elements of one leaf in
other ways: such a leaf is *owned*, placed whole on one device, or layer by layer for
stacked layers the update treats separately (see :mod:`zeroshard.layers`). Mixing
several leaves other than by sums cannot be made exact by placement and is refused.
All of this is read from the traced computation (the jaxpr), not from a list of names.

Every value in the jaxpr carries a tag: a kind and the set of parameter leaves it
derives from. Kinds are ``CLEAN`` (no per-element data), ``ELEM`` (one value per
element of its leaves), ``PARTIAL`` (a sum over this device's elements, not yet
summed over the axis) and ``WHOLE`` (computed from a whole leaf: exact only on the
leaf's owner). A total ``reduce_sum`` turns ``ELEM`` into ``PARTIAL``; where a
``PARTIAL`` value meets a non-linear operation it is summed over the sharded axis
(:func:`zeroshard.sums.run_with_sums` evaluates the update so), or an explicit
``psum`` (:func:`zeroshard.clip_by_global_norm`) does it, and it is ``CLEAN`` again.
Any other mixing makes its one leaf ``WHOLE`` (or is refused across leaves).

A second check compares, leaf by leaf, the operations traced on full leaves with
those traced on slices: a leaf whose update depends on its shape (e.g. factored only
when large, or masked by shape) is owned too.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from zeroshard.jaxprs import ELEMENTWISE, PASS_THROUGH, called_jaxpr, open_jaxpr
from zeroshard.layers import independent_layers
from zeroshard.layout import PyTree, Slot

CLEAN, GENERATED, ELEM, PARTIAL, WHOLE = 0, 1, 2, 3, 4
_NONE: frozenset[int] = frozenset()

# Linear in their one (PARTIAL) operand.
_UNARY_LINEAR = frozenset("neg convert_element_type copy copy_p reduce_sum".split())
_RESHAPING = frozenset(["reshape", "squeeze", "expand_dims", "broadcast_in_dim"])
# Evaluated on invariant operands, these give the same value on every device.
_FREE_TYPED = (
    ELEMENTWISE
    | _RESHAPING
    | frozenset(
        "reduce_sum reduce_max reduce_min dot_general transpose concatenate pad slice".split()
    )
)
_CASTS = PASS_THROUGH | {"convert_element_type", "copy", "copy_p"}
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
      sums: the leaves of each partial sum that meets a non-linear operation (a
        norm, an RMS: one leaf; a global norm: several): where such a sum is partial
        (a leaf in it is sliced, or it spans leaves), the update runs with
        :func:`zeroshard.sums.run_with_sums`.
      layered: of the leaves in ``whole``, the stacked ones whose update treats each
        layer on its own (see :mod:`zeroshard.layers`): they can be owned layer by layer.
      layer_sums: of those, the leaves whose layers meet through total sums: owned
        layer by layer, those sums are summed over the devices, so every device must
        hold some of its layers.
      reads: the leaves whose weights the update reads (weight decay, trust ratios):
        the others' need not reach their owners.
    """

    whole: frozenset[int]
    matrix: frozenset[int]
    state_leaves: tuple[int | None, ...]
    state_tags: tuple[Tag, ...] = ()
    sums: frozenset[frozenset[int]] = frozenset()
    layered: frozenset[int] = frozenset()
    layer_sums: frozenset[int] = frozenset()
    reads: frozenset[int] = frozenset()

    def in_tags(self, num_params: int) -> list[Tag]:
        """Tags of the update's inputs: gradients, state, parameters (extra arguments
        are clean)."""
        params = [(ELEM, frozenset([i])) for i in range(num_params)]
        return params + list(self.state_tags) + params


def _sub_jaxpr(eqn: Any) -> Any:
    sub = called_jaxpr(eqn)
    return None if sub is None else open_jaxpr(sub)


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
                sub = open_jaxpr(s)
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

    def __init__(
        self, axis_name: str, leaf_names: list[str], sliced: Mapping[int, Slot] | None = None
    ):
        self.axis_name, self.leaf_names = axis_name, leaf_names
        # The leaves whose sums are partial here (all of them, on full leaves; on a
        # view, the sliced ones: an owned leaf is whole on its owner).
        self.sliced = sliced
        self.whole: set[int] = set()
        self.matrix: set[int] = set()
        self.ops: dict[int, list[str]] = defaultdict(list)
        self.sums: set[frozenset[int]] = set()
        self._in_branch = 0
        self._counts: dict[Any, int] = {}  # a total sum's value -> the elements it summed
        self._scalars: dict[Any, float] = {}  # a constant scalar's value, once cast

    def _own(self, eqn: Any, leaves: frozenset, why: str) -> Tag:
        """``leaves`` need their whole tensors: refused unless that is one leaf."""
        if len(leaves) > 1:
            names = ", ".join(self.leaf_names[i] for i in sorted(leaves)[:4])
            _refuse(eqn, f"{why} across several parameters ({names}{', ...' * (len(leaves) > 4)})")
        self.whole |= leaves
        if eqn.primitive.name == "dot_general" or (
            (sub := _sub_jaxpr(eqn) or open_jaxpr(eqn.params.get("body_jaxpr")))
            and "dot_general" in _primitives(sub)
        ):
            self.matrix |= leaves
        return (WHOLE, leaves)

    def _layered(self, leaves: frozenset) -> bool:
        """Whether ``leaves`` is one layer-owned leaf whose layers meet through sums."""
        slot = self.sliced.get(next(iter(leaves))) if self.sliced and len(leaves) == 1 else None
        return slot is not None and slot.placement == "layer-owned"

    def _over_layers(self, eqn: Any, leaves: frozenset, kinds: set) -> bool:
        """Whether ``eqn`` sums every element of this device's layers of one
        layer-owned leaf whose layers meet through sums (a partial sum: its other
        layers are on other devices; a sum over some axes is one per layer)."""
        total = len(eqn.params["axes"]) == len(eqn.invars[0].aval.shape)
        return total and kinds <= {ELEM, WHOLE} and self._layered(leaves)

    def _summed_here(self, partial: frozenset) -> bool:
        """Whether the partial sums of ``partial`` meeting a non-linear operation are
        summed over the axis first: a norm, an RMS or a mean of a sliced leaf (LAMB's
        and LARS's trust ratios, Adafactor's update clipping) or of several leaves (a
        global norm). Not inside a conditional (its branches are bound whole), and not
        for a leaf owned here, whose sums are complete on its owner."""
        if self._in_branch:
            return False
        return len(partial) > 1 or self.sliced is None or partial <= self.sliced.keys()

    def run(self, jaxpr: Any, in_tags: list[Tag], values: list | None = None) -> tuple[list, list]:
        """Output tags (and values, given input ``values``) of a (closed) jaxpr."""
        consts = getattr(jaxpr, "consts", ())
        jaxpr = open_jaxpr(jaxpr)
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
        sub = called_jaxpr(eqn)
        if sub is not None and name not in ("scan", "while", "cond"):
            return self.run(sub, ins, xs)  # calls are inlined
        outs = self._tags(eqn, ins)
        if xs is not None:
            xs = self._exact_sums(eqn, ins, xs)
        if outs is None:  # partial sums meet a non-linear operation: sum them over the axis
            summed = [k for k, (kind, _) in enumerate(ins) if kind == PARTIAL]
            self.sums.add(frozenset().union(*(ins[k][1] for k in summed)))
            ins = [_CLEAN if k in summed else t for k, t in enumerate(ins)]
            if xs is not None:  # the same on every device: typed invariant
                xs = [
                    jax.lax.psum(x, self.axis_name) if k in summed else x for k, x in enumerate(xs)
                ]
            outs = self._tags(eqn, ins)
        if xs is None:
            return outs, None
        if name == "pvary":  # a cast tracing inserted: made again where needed (_typed)
            return outs, xs
        xs = _typed(eqn, xs, self.axis_name)
        if name == "cond":  # its branches evaluated here too, sums made whole inside
            return outs, self._switch(eqn, ins, xs)
        params = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = params if isinstance(params, tuple) else ((), params)  # older jax
        ys = eqn.primitive.bind(*subfuns, *xs, **params)
        return outs, ys if eqn.primitive.multiple_results else [ys]

    def _switch(self, eqn: Any, ins: list[Tag], xs: list) -> list:
        """A conditional evaluated branch by branch (see :meth:`_branch`); the outputs
        typed as traced where the branches' types differ."""
        runs = [self._branch(b, ins) for b in eqn.params["branches"]]
        try:
            return jax.lax.switch(xs[0], [lambda *a, r=r: r(list(a))[1] for r in runs], *xs[1:])
        except TypeError:  # the branches' output types differ: type them as traced
            axis = self.axis_name
            as_traced = lambda ys: [
                jax.lax.pcast(y, axis, to="varying")
                if axis in v.aval.manual_axis_type.varying
                and axis not in jax.typeof(y).manual_axis_type.varying
                else y
                for y, v in zip(ys, eqn.outvars, strict=True)
            ]
            branches = [lambda *a, r=r: as_traced(r(list(a))[1]) for r in runs]
            return jax.lax.switch(xs[0], branches, *xs[1:])

    def _branch(self, jaxpr: Any, ins: list[Tag]) -> Any:
        """A conditional's branch as a function of its operands' values (``None``: tags
        only). Sums inside are made whole only where every device takes the same branch
        (a clean index, such as a step count); a branch chosen by per-element data is
        evaluated as it is."""
        uniform = ins[0] == _CLEAN

        def run(values: list | None) -> tuple[list, list]:
            self._in_branch += not uniform
            try:
                return self.run(jaxpr, ins[1:], values)
            finally:
                self._in_branch -= not uniform

        return run

    def _exact_sums(self, eqn: Any, ins: list[Tag], xs: list) -> list:
        """``eqn``'s operands on a sliced leaf's piece, made to give the leaf's own sums:
        padding left out of a total sum, and a mean divided by the leaf's size."""
        (kind, leaves), one = ins[0], None
        if len(leaves) == 1 and self.sliced is not None:
            one = self.sliced.get(next(iter(leaves)))
        if one is None:
            return xs
        if eqn.primitive.name == "reduce_sum" and kind == ELEM and not one.owned:
            if xs[0].size == one.piece_size and one.piece_size * one.num_shards != one.size:
                mask = one.padding_mask(jax.lax.axis_index(self.axis_name))
                return [jnp.where(mask.reshape(xs[0].shape), xs[0], 0), *xs[1:]]
        elif self._mean_count(eqn, ins) is not None:
            size = jnp.asarray(one.size, xs[1].dtype)
            if self.axis_name in jax.typeof(xs[1]).manual_axis_type.varying:
                size = jax.lax.pcast(size, self.axis_name, to="varying")
            return [xs[0], size]
        return xs

    def _mean_count(self, eqn: Any, ins: list[Tag]) -> int | None:
        """For a total sum divided by the number of elements summed (a mean), that number."""
        if eqn.primitive.name != "div" or ins[0][0] != PARTIAL or ins[1] != _CLEAN:
            return None
        count = self._counts.get(eqn.invars[0])
        return count if count is not None and self._scalar(eqn.invars[1]) == count else None

    def _scalar(self, v: Any) -> float | None:
        """The value of a constant scalar: a literal, or one cast (to varying, say)."""
        if isinstance(v, jex_core.Literal):
            return float(v.val) if np.ndim(v.val) == 0 else None
        return self._scalars.get(v)

    def _tags(self, eqn: Any, ins: list[Tag]) -> list[Tag] | None:
        """The output tags of ``eqn``, or ``None`` where partial sums must first be summed
        over the axis (see :meth:`_summed_here`)."""
        name = eqn.primitive.name
        kinds = {k for k, _ in ins}
        leaves = frozenset().union(*(s for _, s in ins))
        n_out = len(eqn.outvars)
        if name not in _RESHAPING:
            label = "mean" if self._mean_count(eqn, ins) is not None else name
            for i in leaves:
                self.ops[i].append(label)
        if name == "cond":
            branches = [self._branch(b, ins)(None)[0] for b in eqn.params["branches"]]
            if ins[0] != _CLEAN:
                return [self._own(eqn, leaves, "branches on per-element data")] * n_out
            return [
                (max(k for k, _ in ts), frozenset().union(*(s for _, s in ts)))
                for ts in zip(*branches, strict=True)
            ]
        if kinds <= {CLEAN, GENERATED}:
            if name in _CASTS and (value := self._scalar(eqn.invars[0])) is not None:
                self._scalars[eqn.outvars[0]] = value
            generated = GENERATED in kinds or name in _GENERATORS
            big = generated and any(v.aval.size > 1 for v in eqn.outvars)
            return [(GENERATED, _NONE) if big else _CLEAN] * n_out
        if name.startswith("psum") and self.axis_name in eqn.params.get("axes", ()):
            if kinds & {ELEM, WHOLE}:
                _refuse(eqn, "sums per-element or whole-tensor values across devices")
            return [_CLEAN] * n_out
        if name == "reduce_sum" and self._over_layers(eqn, leaves, kinds):
            self._counts[eqn.outvars[0]] = eqn.invars[0].aval.size
            return [(PARTIAL, leaves)]
        if GENERATED in kinds:
            why = "combines values generated at the leaf's shape (random numbers, iota)"
            return [self._own(eqn, leaves, why)] * n_out
        if WHOLE in kinds:
            return [self._own(eqn, leaves, "combines a whole-tensor value")] * n_out
        if PARTIAL in kinds:
            # A clean zero added is a partial sum of nothing (``sum(squares, 0.0)``).
            zero = lambda k, v: k == CLEAN and name in ("add", "sub") and self._scalar(v) == 0
            if _linear(
                name,
                [PARTIAL if zero(k, v) else k for (k, _), v in zip(ins, eqn.invars, strict=True)],
            ):
                return [(PARTIAL, leaves)] * n_out
            partial = frozenset().union(*(s for k, s in ins if k == PARTIAL))
            if self._summed_here(partial):
                return None
            why = "uses a sum over this device's elements only (a norm without a psum)"
            return [self._own(eqn, leaves, why)] * n_out
        if name == "reduce_sum" and eqn.outvars[0].aval.size == 1 and not self._layered(leaves):
            self._counts[eqn.outvars[0]] = eqn.invars[0].aval.size
            return [(PARTIAL, leaves)]
        if name in ELEMENTWISE or name in PASS_THROUGH:
            return [(ELEM, leaves)] * n_out
        if name in _RESHAPING and eqn.invars[0].aval.size == eqn.outvars[0].aval.size:
            return [(ELEM, leaves)]
        why = "mixes elements (a reduction, matmul, slice or reorder)"
        return [self._own(eqn, leaves, why)] * n_out


def _typed(eqn: Any, xs: list, axis: str) -> list:
    """``eqn``'s operands typed varying over the axis where it needs them so.

    A sum made whole is typed invariant (the same on every device), where the
    traced jaxpr had it varying; so is what is computed from it alone (the new
    value of a replicated state leaf, such as novograd's per-leaf second moment,
    stays replicated). Such an operand is cast back to varying where it meets a
    varying one, as tracing would have cast it, and where the equation is a
    collective or a loop (bound as traced)."""
    varying = lambda x: isinstance(x, jax.Array) and axis in jax.typeof(x).manual_axis_type.varying
    traced = [
        isinstance(v, jex_core.Var) and axis in v.aval.manual_axis_type.varying for v in eqn.invars
    ]
    if not any(t and not varying(x) for t, x in zip(traced, xs, strict=True)):
        return xs
    if eqn.primitive.name in _FREE_TYPED and not any(map(varying, xs)):
        return xs
    return [
        jax.lax.pcast(x, axis, to="varying") if t and not varying(x) else x
        for t, x in zip(traced, xs, strict=True)
    ]


def _linear(name: str, kinds: list[int]) -> bool:
    """Whether an equation is linear in its ``PARTIAL`` operands, so that summing its
    output over the devices equals applying it to their sums: scaling by clean
    values, and adding, selecting or joining partial sums only (a clean term added
    to a partial sum would be added once per device)."""
    partial = [k == PARTIAL for k in kinds]
    if name in _UNARY_LINEAR or name in _RESHAPING:
        return len(kinds) == 1
    if name == "mul":
        return sum(partial) == 1 and all(k in (CLEAN, PARTIAL) for k in kinds)
    if name == "div":
        return kinds == [PARTIAL, CLEAN]
    if name in ("add", "sub", "concatenate"):
        return all(partial)
    if name == "select_n":
        return kinds[0] == CLEAN and all(partial[1:])
    return False


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
    stacked: tuple[int, ...] = (),
    extra_args: dict[str, Any] | None = None,
) -> Analysis:
    """Finds the leaves whose inner update needs the whole tensor (or whole layers).

    Args:
      inner: the optax transformation to run on this device's part of the parameters.
      full_params: ``ShapeDtypeStruct`` tree of the full parameters (master dtype).
      full_state: ``jax.eval_shape(inner.init, full_params)``.
      piece_params: the same tree with this device's slices.
      piece_state: ``jax.eval_shape(inner.init, piece_params)``.
      axis_name: the sharded mesh axis.
      num_shards: its size.
      stacked: per leaf, its number of leading layer axes (none if empty).
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
    candidates = [i for i in sorted(whole) if stacked and stacked[i] == 1]
    layered, layer_sums = _layered((full_params, full_state), full, state_leaves, candidates)
    if layered:  # does the update do on one layer what it does on all of them?
        params, state = _some_layers(inner, full_params, full_state, state_leaves, layered)
        one = layered and _trace(inner, params, state, axis_name, num_shards, extra)[0]
        if one and _primitives(open_jaxpr(one)) != _primitives(open_jaxpr(full)):
            layered = set()
    return Analysis(
        frozenset(whole),
        frozenset(tagger.matrix),
        state_leaves,
        tuple(state_in),
        frozenset(tagger.sums),
        frozenset(layered),
        frozenset(layer_sums & layered),
        _reads(full, n_params, n_state),
    )


def _reads(closed: Any, n_params: int, n_state: int) -> frozenset[int]:
    """The parameter leaves whose weights (inputs after the gradients and the state)
    the traced update uses at all."""
    jaxpr = open_jaxpr(closed)
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    weights = jaxpr.invars[n_params + n_state : 2 * n_params + n_state]
    return frozenset(i for i, v in enumerate(weights) if id(v) in used)


def _layered(full, closed, state_leaves, candidates) -> tuple[set[int], set[int]]:
    """The candidate leaves whose traced update (``closed``, on the ``full`` parameters
    and state) is independent layer by layer, and whose state keeps the layers first."""
    params, state = (jax.tree.leaves(x) for x in full)
    layers = {i: params[i].shape[0] for i in candidates}
    state_axes = [
        {j: 0 if s.shape[:1] == (layers[j],) else None} if j in layers else {}
        for s, j in zip(state, state_leaves, strict=True)
    ]
    param_axes = [{i: 0} if i in layers else {} for i in range(len(params))]
    extra = len(open_jaxpr(closed).invars) - 2 * len(params) - len(state)
    in_axes = param_axes + state_axes + param_axes + [{}] * extra
    return independent_layers(closed, in_axes, len(params)) if layers else (set(), set())


def _some_layers(inner, full_params, full_state, state_leaves, layered):
    """The parameters with one layer of each ``layered`` leaf, and their state; drops
    from ``layered`` a leaf whose state on one layer is not one layer of its state."""
    one = lambda i, x: jax.ShapeDtypeStruct((1, *x.shape[1:]) if i in layered else x.shape, x.dtype)
    leaves, treedef = jax.tree.flatten(full_params)
    params = treedef.unflatten(one(i, x) for i, x in enumerate(leaves))
    state = jax.eval_shape(inner.init, params)
    if jax.tree.structure(state) != jax.tree.structure(full_state):
        layered.clear()
        return params, state
    pairs = zip(jax.tree.leaves(full_state), jax.tree.leaves(state), strict=True)
    for j, (full, x) in zip(state_leaves, pairs, strict=True):
        if j in layered and tuple(x.shape) != (1, *full.shape[1:]):
            layered.discard(j)
    return params, state


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
