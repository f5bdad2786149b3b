"""Tags: what each value of the traced inner update derives from.

Every value in the jaxpr carries a tag: a kind and the set of parameter leaves it
derives from. Kinds are ``CLEAN`` (no per-element data), ``ELEM`` (one value per
element of its leaves), ``PARTIAL`` (a sum over this device's elements, not yet
summed over the axis) and ``WHOLE`` (computed from a whole leaf: exact only on the
leaf's owner). A total ``reduce_sum`` turns ``ELEM`` into ``PARTIAL``; where a
``PARTIAL`` value meets a non-linear operation it is summed over the sharded axis
(:class:`Tagger` records where, as :class:`Sums`, and :func:`zeroshard.core.sums.evaluate`
evaluates the update so), or an explicit ``psum`` (:func:`zeroshard.clip_by_global_norm`)
does it, and it is ``CLEAN`` again. Any other mixing makes its one leaf ``WHOLE`` (or
is refused across leaves).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from zeroshard.analysis.jaxprs import KEEPS_SHAPE, PASS_THROUGH, RESHAPING, has_matmul, walk
from zeroshard.communication.collectives import axes_of
from zeroshard.core.layout import Slot

CLEAN, GENERATED, ELEM, PARTIAL, WHOLE = 0, 1, 2, 3, 4
_NONE: frozenset[int] = frozenset()

_CASTS = PASS_THROUGH | {"convert_element_type", "copy", "copy_p"}
# Make values at a given shape from no per-element data: on a slice they would differ.
_GENERATORS = frozenset(["random_bits", "threefry2x32", "rng_bit_generator", "iota"])

Tag = tuple[int, frozenset]
CLEAN_TAG: Tag = (CLEAN, _NONE)

# Per primitive, whether it is linear in its ``PARTIAL`` operands (given its operands'
# kinds), so that summing its output over the devices equals applying it to their sums:
# scaling by clean values, and adding, selecting or joining partial sums only (a clean
# term added to a partial sum would be added once per device).
_UNARY_LINEAR = ["neg", "convert_element_type", "copy", "copy_p", "reduce_sum", *RESHAPING]
_LINEAR = {
    **dict.fromkeys(_UNARY_LINEAR, lambda kinds: len(kinds) == 1),
    "mul": lambda kinds: kinds.count(PARTIAL) == 1 and set(kinds) <= {CLEAN, PARTIAL},
    "div": lambda kinds: kinds == [PARTIAL, CLEAN],
    **dict.fromkeys(["add", "sub", "concatenate"], lambda kinds: set(kinds) == {PARTIAL}),
    "select_n": lambda kinds: kinds[0] == CLEAN and set(kinds[1:]) == {PARTIAL},
}


@dataclasses.dataclass(frozen=True)
class Sums:
    """What one equation's operands need to give the sums over whole leaves.

    Attributes:
      summed: the operands that are partial sums meeting a non-linear operation: summed
        over the axis first.
      mask: for a total sum over a sliced leaf's piece, the leaf (its padding left out).
      size: for a mean over a sliced leaf's piece, the leaf's size (the divisor).
      branches: for a conditional, the sums of each branch.
      partial: for a total sum of one sliced leaf's per-element values (a partial
        sum), the leaf, where the sum is taken in a fixed order instead
        (``deterministic=``, :mod:`zeroshard.communication.canonical`); of an owned leaf the sum is
        complete on its owner, and stays as it is.
      psum: an explicit ``psum`` of partial sums over the axis.
      whole: whether the ``summed`` partial sums include one of a leaf updated whole
        on its owner (complete there, zero elsewhere).
    """

    summed: tuple[int, ...] = ()
    mask: Slot | None = None
    size: int | None = None
    branches: tuple[tuple[Sums | None, ...], ...] = ()
    partial: int | None = None
    psum: bool = False
    whole: bool = False


Program = tuple[Sums | None, ...]
"""Per equation of a jaxpr, in the order :func:`~zeroshard.analysis.jaxprs.walk` visits them
(calls inlined), its :class:`Sums` (``None``: bound as traced)."""


class NotElementwiseError(ValueError):
    """The inner optimizer mixes parameters in a way no placement makes exact."""


def _refuse(eqn: Any, why: str) -> None:
    """Raises :class:`NotElementwiseError` for ``eqn``, at the first line of the user's
    code (not jax's or the analysis's) that traced it, where known."""
    tb, internal = eqn.source_info.traceback, ("/jax/", "zeroshard/analysis", "zeroshard/sums")
    frames = tb.frames if tb is not None else ()
    f = next((f for f in frames if not any(s in f.file_name for s in internal)), None)
    where = "" if f is None else f" (at {f.file_name}:{getattr(f, 'line_num', '?')})"
    raise NotElementwiseError(f"`{eqn.primitive.name}` {why}{where}")


class Tagger:
    """Propagates tags through a jaxpr, collecting the leaves that need whole tensors
    and, per leaf, the primitives applied to its data.

    Where several leaves' partial sums meet a non-linear operation (a global norm, as
    in ``optax.clip_by_global_norm``), the partial sums are summed over the axis
    first: ``sums`` records the leaves, :meth:`run` returns where (its equations'
    :class:`Sums`, which :func:`zeroshard.core.sums.evaluate` follows).
    """

    def __init__(
        self, axis_name: str, leaf_names: list[str], sliced: Mapping[int, Slot] | None = None
    ):
        # ``sliced``: the leaves whose sums are partial here (all of them, on full leaves;
        # on a view, the sliced ones: an owned leaf is whole on its owner).
        self.axis_name, self.leaf_names, self.sliced = axis_name, leaf_names, sliced
        self.whole: set[int] = set()
        self.matrix: set[int] = set()
        self.ops: dict[int, list[str]] = defaultdict(list)
        self.sums: set[frozenset[int]] = set()
        self._in_branch = 0
        self._branches: tuple[Program, ...] = ()  # of the last conditional tagged
        self._counts: dict[Any, int] = {}  # a total sum's value -> the elements it summed
        self._scalars: dict[Any, float] = {}  # a constant scalar's value, once cast

    def _own(self, eqn: Any, leaves: frozenset, why: str) -> list[Tag]:
        """``leaves`` need their whole tensors: refused unless that is one leaf. Returns
        the tags of ``eqn``'s outputs."""
        if len(leaves) > 1:
            names = ", ".join(self.leaf_names[i] for i in sorted(leaves)[:4])
            _refuse(eqn, f"{why} across several parameters ({names}{', ...' * (len(leaves) > 4)})")
        self.whole |= leaves
        if has_matmul(eqn):
            self.matrix |= leaves
        return [(WHOLE, leaves)] * len(eqn.outvars)

    def _slot(self, leaves: frozenset) -> Slot | None:
        """The slot of ``leaves`` where that is one leaf whose sums are partial here."""
        return self.sliced.get(next(iter(leaves))) if self.sliced and len(leaves) == 1 else None

    def _partial_sum(self, eqn: Any, leaves: frozenset, kinds: set) -> bool:
        """Whether ``eqn``, a ``reduce_sum``, gives a partial sum: a total one of
        per-element values, or, of a layer-owned leaf whose layers meet through sums,
        one of every element of this device's layers (its other layers are on other
        devices; a sum over some axes is one per layer, complete here)."""
        if (slot := self._slot(leaves)) is not None and slot.layered:
            return kinds <= {ELEM, WHOLE} and len(eqn.params["axes"]) == eqn.invars[0].aval.ndim
        return kinds == {ELEM} and eqn.outvars[0].aval.size == 1

    def run(self, jaxpr: Any, in_tags: list[Tag]) -> tuple[list[Tag], Program]:
        """Output tags of a (closed) jaxpr (its inputs past ``in_tags`` clean), and the
        :class:`Sums` of its equations."""
        program: list[Sums | None] = []
        outs = walk(jaxpr, in_tags, lambda eqn, ins: self._eqn(eqn, ins, program), CLEAN_TAG)
        return outs, tuple(program)

    def _eqn(self, eqn: Any, ins: list[Tag], program: list[Sums | None]) -> list[Tag]:
        """The output tags of ``eqn``; its :class:`Sums` appended to ``program``."""
        outs, summed, whole = self._tags(eqn, ins), (), False
        if outs is None:  # partial sums meet a non-linear operation: sum them over the axis
            summed = tuple(k for k, (kind, _) in enumerate(ins) if kind == PARTIAL)
            leaves = frozenset().union(*(ins[k][1] for k in summed))
            self.sums.add(leaves)
            whole = not leaves <= (self.sliced or {}).keys()
            outs = self._tags(eqn, [CLEAN_TAG if k in summed else t for k, t in enumerate(ins)])
        name, kinds = eqn.primitive.name, [k for k, _ in ins]
        branches = self._branches if name == "cond" else ()
        partial, sliced = None, self.sliced or {}
        if name == "reduce_sum" and PARTIAL not in kinds and outs[0][0] == PARTIAL:
            leaves = outs[0][1]
            partial = next(iter(leaves)) if len(leaves) == 1 and leaves <= sliced.keys() else None
        psum = name.startswith("psum") and PARTIAL in kinds
        sums = Sums(summed, *self._exact(eqn, ins), branches, partial, psum, whole)
        program.append(None if sums == Sums() else sums)
        return outs

    def _cond(self, eqn: Any, ins: list[Tag], leaves: frozenset) -> list[Tag]:
        """A conditional's output tags (its branches' programs kept for :meth:`_eqn`).
        Sums inside are made whole only where every device takes the same branch (a
        clean index, such as a step count); a branch chosen by per-element data is
        evaluated as it is."""
        uniform = ins[0] == CLEAN_TAG
        self._in_branch += not uniform
        runs = [self.run(b, ins[1:]) for b in eqn.params["branches"]]
        tags, self._branches = zip(*runs, strict=True)
        self._in_branch -= not uniform
        if not uniform:
            return self._own(eqn, leaves, "branches on per-element data")
        outs = zip(*tags, strict=True)
        return [(max(k for k, _ in ts), frozenset().union(*(s for _, s in ts))) for ts in outs]

    def _exact(self, eqn: Any, ins: list[Tag]) -> tuple[Slot | None, int | None]:
        """For ``eqn`` on a sliced leaf's piece, what makes it give the leaf's own sums:
        the leaf, whose padding a total sum leaves out, or the leaf's size, by which a
        mean divides."""
        kind, leaves = ins[0] if ins else CLEAN_TAG
        if (one := self._slot(leaves)) is None:
            return None, None
        padded = one.piece_size * one.num_shards != one.size
        if eqn.primitive.name == "reduce_sum" and kind == ELEM and not one.owned and padded:
            return (one if eqn.invars[0].aval.size == one.piece_size else None), None
        return None, (one.size if self._mean_count(eqn, ins) is not None else None)

    def _mean_count(self, eqn: Any, ins: list[Tag]) -> int | None:
        """For a total sum divided by the number of elements summed (a mean), that number."""
        if eqn.primitive.name != "div" or ins[0][0] != PARTIAL or ins[1] != CLEAN_TAG:
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
        over the axis."""
        name = eqn.primitive.name
        kinds = {k for k, _ in ins}
        leaves = frozenset().union(*(s for _, s in ins))
        n_out = len(eqn.outvars)
        if name not in RESHAPING:
            label = "mean" if self._mean_count(eqn, ins) is not None else name
            for i in leaves:
                self.ops[i].append(label)
        if name == "cond":
            return self._cond(eqn, ins, leaves)
        if kinds <= {CLEAN, GENERATED}:
            if name in _CASTS and (value := self._scalar(eqn.invars[0])) is not None:
                self._scalars[eqn.outvars[0]] = value
            generated = GENERATED in kinds or name in _GENERATORS
            big = generated and any(v.aval.size > 1 for v in eqn.outvars)
            return [(GENERATED, _NONE) if big else CLEAN_TAG] * n_out
        if name.startswith("psum") and set(axes_of(self.axis_name)) <= set(
            eqn.params.get("axes", ())
        ):
            if kinds & {ELEM, WHOLE}:
                _refuse(eqn, "sums per-element or whole-tensor values across devices")
            return [CLEAN_TAG] * n_out
        if name == "reduce_sum" and self._partial_sum(eqn, leaves, kinds):
            self._counts[eqn.outvars[0]] = eqn.invars[0].aval.size
            return [(PARTIAL, leaves)]
        if GENERATED in kinds:
            why = "combines values generated at the leaf's shape (random numbers, iota)"
            return self._own(eqn, leaves, why)
        if WHOLE in kinds:
            return self._own(eqn, leaves, "combines a whole-tensor value")
        if PARTIAL in kinds:
            # A clean zero added is a partial sum of nothing (``sum(squares, 0.0)``).
            zero = lambda k, v: k == CLEAN and name in ("add", "sub") and self._scalar(v) == 0
            pairs = zip(ins, eqn.invars, strict=True)
            linear = _LINEAR.get(name, lambda kinds: False)
            if linear([PARTIAL if zero(k, v) else k for (k, _), v in pairs]):
                return [(PARTIAL, leaves)] * n_out
            # Partial sums meeting a non-linear operation are summed over the axis first
            # (``None``): a norm, an RMS or a mean of a sliced leaf (LAMB's and LARS's trust
            # ratios, Adafactor's update clipping) or of several leaves (a global norm). Not
            # inside a conditional (its branches are bound whole), and not for a leaf owned
            # here, whose sums are complete on its owner.
            partial = frozenset().union(*(s for k, s in ins if k == PARTIAL))
            summable = len(partial) > 1 or self.sliced is None or partial <= self.sliced.keys()
            if summable and not self._in_branch:
                return None
            why = "uses a sum over this device's elements only (a norm without a psum)"
            return self._own(eqn, leaves, why)
        same_size = name in RESHAPING and eqn.invars[0].aval.size == eqn.outvars[0].aval.size
        if name in KEEPS_SHAPE or same_size:
            return [(ELEM, leaves)] * n_out
        return self._own(eqn, leaves, "mixes elements (a reduction, matmul, slice or reorder)")
