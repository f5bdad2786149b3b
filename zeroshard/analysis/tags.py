"""Tags: what each value of the traced inner update derives from.

Every value in the jaxpr carries a tag: a kind and the set of parameter leaves it
derives from. Kinds are ``CLEAN`` (no per-element data), ``ELEM`` (one value per
element of its leaves), ``PARTIAL`` (a sum over this device's elements, not yet
summed over the axis) and ``WHOLE`` (computed from a whole leaf: exact only on the
leaf's owner). A total ``reduce_sum`` turns ``ELEM`` into ``PARTIAL``; where a
``PARTIAL`` value meets a non-linear operation it is summed over the sharded axis
(:class:`Tagger` records where, as :class:`Sums`, and :func:`zeroshard.sums.evaluate`
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

from zeroshard.analysis.jaxprs import (
    KEEPS_SHAPE,
    PASS_THROUGH,
    RESHAPING,
    called_jaxpr,
    open_jaxpr,
    primitives,
)
from zeroshard.layout import Slot

CLEAN, GENERATED, ELEM, PARTIAL, WHOLE = 0, 1, 2, 3, 4
_NONE: frozenset[int] = frozenset()

# Linear in their one (PARTIAL) operand.
_UNARY_LINEAR = frozenset("neg convert_element_type copy copy_p reduce_sum".split())
_CASTS = PASS_THROUGH | {"convert_element_type", "copy", "copy_p"}
# Make values at a given shape from no per-element data: on a slice they would differ.
_GENERATORS = frozenset(["random_bits", "threefry2x32", "rng_bit_generator", "iota"])

Tag = tuple[int, frozenset]
CLEAN_TAG: Tag = (CLEAN, _NONE)


@dataclasses.dataclass(frozen=True)
class Sums:
    """What one equation's operands need to give the sums over whole leaves.

    Attributes:
      summed: the operands that are partial sums meeting a non-linear operation: summed
        over the axis first.
      mask: for a total sum over a sliced leaf's piece, the leaf (its padding left out).
      size: for a mean over a sliced leaf's piece, the leaf's size (the divisor).
      calls: the sums of the jaxpr the equation calls (one; inlined) or of each branch
        of a conditional.
    """

    summed: tuple[int, ...] = ()
    mask: Slot | None = None
    size: int | None = None
    calls: tuple[tuple[Sums | None, ...], ...] = ()


Program = tuple[Sums | None, ...]
"""Per equation of a jaxpr, its :class:`Sums` (``None``: bound as traced)."""


class NotElementwiseError(ValueError):
    """The inner optimizer mixes parameters in a way no placement makes exact."""


def _where(eqn: Any) -> str:
    frame = eqn.source_info.traceback
    if frame is None:
        return ""
    for f in frame.frames:
        if not any(s in f.file_name for s in ("/jax/", "zeroshard/analysis", "zeroshard/sums")):
            return f" (at {f.file_name}:{getattr(f, 'line_num', '?')})"
    return ""


def _refuse(eqn: Any, why: str) -> None:
    raise NotElementwiseError(f"`{eqn.primitive.name}` {why}{_where(eqn)}")


class Tagger:
    """Propagates tags through a jaxpr, collecting the leaves that need whole tensors
    and, per leaf, the primitives applied to its data.

    Where several leaves' partial sums meet a non-linear operation (a global norm, as
    in ``optax.clip_by_global_norm``), the partial sums are summed over the axis
    first: ``sums`` records the leaves, :meth:`run` returns where (its equations'
    :class:`Sums`, which :func:`zeroshard.sums.evaluate` follows).
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
        self._branches: tuple[Program, ...] = ()  # of the last conditional tagged
        self._counts: dict[Any, int] = {}  # a total sum's value -> the elements it summed
        self._scalars: dict[Any, float] = {}  # a constant scalar's value, once cast

    def _own(self, eqn: Any, leaves: frozenset, why: str) -> Tag:
        """``leaves`` need their whole tensors: refused unless that is one leaf."""
        if len(leaves) > 1:
            names = ", ".join(self.leaf_names[i] for i in sorted(leaves)[:4])
            _refuse(eqn, f"{why} across several parameters ({names}{', ...' * (len(leaves) > 4)})")
        self.whole |= leaves
        if eqn.primitive.name == "dot_general" or (
            (sub := open_jaxpr(called_jaxpr(eqn)) or open_jaxpr(eqn.params.get("body_jaxpr")))
            and "dot_general" in primitives(sub)
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

    def run(self, jaxpr: Any, in_tags: list[Tag]) -> tuple[list[Tag], Program]:
        """Output tags of a (closed) jaxpr, and the :class:`Sums` of its equations."""
        jaxpr = open_jaxpr(jaxpr)
        tags: dict[Any, Tag] = dict(zip(jaxpr.invars, in_tags, strict=True))
        tag = lambda v: tags.get(v, CLEAN_TAG) if isinstance(v, jex_core.Var) else CLEAN_TAG
        program = []
        for eqn in jaxpr.eqns:
            outs, sums = self._eqn(eqn, [tag(v) for v in eqn.invars])
            tags.update(zip(eqn.outvars, outs, strict=True))
            program.append(sums)
        return [tag(v) for v in jaxpr.outvars], tuple(program)

    def _eqn(self, eqn: Any, ins: list[Tag]) -> tuple[list[Tag], Sums | None]:
        sub = called_jaxpr(eqn)
        if sub is not None and eqn.primitive.name not in ("scan", "while", "cond"):
            outs, program = self.run(sub, ins)  # calls are inlined
            return outs, Sums(calls=(program,))
        outs = self._tags(eqn, ins)
        mask, size = self._exact(eqn, ins)
        summed: tuple[int, ...] = ()
        if outs is None:  # partial sums meet a non-linear operation: sum them over the axis
            summed = tuple(k for k, (kind, _) in enumerate(ins) if kind == PARTIAL)
            self.sums.add(frozenset().union(*(ins[k][1] for k in summed)))
            outs = self._tags(eqn, [CLEAN_TAG if k in summed else t for k, t in enumerate(ins)])
        calls = self._branches if eqn.primitive.name == "cond" else ()
        if summed or mask or size or calls:
            return outs, Sums(summed, mask, size, calls)
        return outs, None

    def _branch(self, jaxpr: Any, ins: list[Tag]) -> tuple[list[Tag], Program]:
        """A conditional's branch. Sums inside are made whole only where every device
        takes the same branch (a clean index, such as a step count); a branch chosen by
        per-element data is evaluated as it is."""
        uniform = ins[0] == CLEAN_TAG
        self._in_branch += not uniform
        try:
            return self.run(jaxpr, ins[1:])
        finally:
            self._in_branch -= not uniform

    def _exact(self, eqn: Any, ins: list[Tag]) -> tuple[Slot | None, int | None]:
        """For ``eqn`` on a sliced leaf's piece, what makes it give the leaf's own sums:
        the leaf, whose padding a total sum leaves out, or the leaf's size, by which a
        mean divides."""
        (kind, leaves), one = ins[0] if ins else CLEAN_TAG, None
        if len(leaves) == 1 and self.sliced is not None:
            one = self.sliced.get(next(iter(leaves)))
        if one is None:
            return None, None
        if eqn.primitive.name == "reduce_sum" and kind == ELEM and not one.owned:
            size = eqn.invars[0].aval.size
            if size == one.piece_size and one.piece_size * one.num_shards != one.size:
                return one, None
        elif self._mean_count(eqn, ins) is not None:
            return None, one.size
        return None, None

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
        over the axis (see :meth:`_summed_here`)."""
        name = eqn.primitive.name
        kinds = {k for k, _ in ins}
        leaves = frozenset().union(*(s for _, s in ins))
        n_out = len(eqn.outvars)
        if name not in RESHAPING:
            label = "mean" if self._mean_count(eqn, ins) is not None else name
            for i in leaves:
                self.ops[i].append(label)
        if name == "cond":
            runs = [self._branch(b, ins) for b in eqn.params["branches"]]
            self._branches = tuple(program for _, program in runs)
            branches = [tags for tags, _ in runs]
            if ins[0] != CLEAN_TAG:
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
            return [(GENERATED, _NONE) if big else CLEAN_TAG] * n_out
        if name.startswith("psum") and self.axis_name in eqn.params.get("axes", ()):
            if kinds & {ELEM, WHOLE}:
                _refuse(eqn, "sums per-element or whole-tensor values across devices")
            return [CLEAN_TAG] * n_out
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
        if name in KEEPS_SHAPE:
            return [(ELEM, leaves)] * n_out
        if name in RESHAPING and eqn.invars[0].aval.size == eqn.outvars[0].aval.size:
            return [(ELEM, leaves)]
        why = "mixes elements (a reduction, matmul, slice or reorder)"
        return [self._own(eqn, leaves, why)] * n_out


def _linear(name: str, kinds: list[int]) -> bool:
    """Whether an equation is linear in its ``PARTIAL`` operands, so that summing its
    output over the devices equals applying it to their sums: scaling by clean
    values, and adding, selecting or joining partial sums only (a clean term added
    to a partial sum would be added once per device)."""
    partial = [k == PARTIAL for k in kinds]
    if name in _UNARY_LINEAR or name in RESHAPING:
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
