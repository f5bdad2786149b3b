"""Blocks: a whole-tensor update run on every device, each on its block of the leaf.

An update that needs a whole matrix (Adafactor's factored moments, Muon's
Newton-Schulz) usually needs it only through reductions along one axis: a row sum and
a column sum; the Gram matrix ``X Xᵀ``, a sum over the wide axis. With the leaf cut
into blocks along the other axis, every device computes its block's part and one
``psum`` of the small reduced value gives what the whole matrix gives. The update is
traced at the leaf's *full* shape, so whatever it derives from the shape (whether to
factor, whether to transpose, ``sqrt(fan_out / fan_in)``) is what plain optax computes;
:meth:`Evaluator.evaluate` evaluates that jaxpr equation by equation on the blocks. Each
value carries where it lives (:class:`Block`): whole (the traced value, the same on
every device), this device's block along one of its axes, or a partial sum over the
devices' blocks, summed (``psum``) where it is first used other than linearly. The
shape parameters of the equations that touch blocks (``broadcast_in_dim``,
``reshape``, ``slice``) are rewritten to the block's size; an equation this cannot
follow exactly (a matrix product over two blocked free axes, a loop other than
``scan``) raises :class:`NotBlockable`, and the plan keeps the leaf whole on one device
(:func:`blockable` tries it at plan time, on shapes). A block of columns is exchanged
with the pieces (blocks of rows) by :func:`to_columns` and :func:`to_rows`.

Equations on values that are not blocks are bound as :mod:`zeroshard.core.sums` binds them
(with its sums over sliced leaves), so one evaluation serves the whole tree
(:func:`run_blocked`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.extend import core as jex_core

from zeroshard.analysis.jaxprs import ELEMENTWISE, PASS_THROUGH, open_jaxpr, scan_parts, walk
from zeroshard.analysis.tags import Program, Sums, Tagger
from zeroshard.communication.collectives import axis_env, varies, vary
from zeroshard.core.sums import bound

PARTIAL = "partial"
"""The axis of a :class:`Block` that is a partial sum: its sum over the devices is the value."""

# Linear in a partial operand, so that summing the output over the devices equals
# applying the equation to the sums (scaled by whole values; partial sums added).
_UNARY = {"neg", "convert_element_type", "copy", "copy_p", "reduce_sum", "reshape", "squeeze"}
_UNARY |= {"broadcast_in_dim", "transpose"}


class NotBlockable(Exception):
    """The update cannot be followed exactly on blocks (the leaf stays whole)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """A value during :meth:`Evaluator.evaluate`.

    Attributes:
      value: the array this device holds.
      axis: ``None`` (the whole traced value, the same on every device), an axis
        (this device's block of the traced value along it) or :data:`PARTIAL`.
    """

    value: Any
    axis: int | str | None


@dataclasses.dataclass
class Evaluator:
    """Evaluates jaxprs on blocks over ``axis_name`` (``num_shards`` devices).

    Attributes:
      axis_name: the mesh axis the blocks are spread over.
      num_shards: its size.
      small: the most elements a blocked value may have to be gathered whole where
        two blocks along different axes meet (a factor vector, say); larger ones
        raise :class:`NotBlockable`.
    """

    axis_name: str
    num_shards: int
    small: int = 1 << 16
    _summed: dict = dataclasses.field(default_factory=dict)

    # Converting between forms.

    def whole(self, b: Block, var: Any) -> Any:
        """The whole traced value of ``b`` (``var``: its traced variable)."""
        if b.axis is None:
            return b.value
        if id(b) in self._summed:  # (the block is kept with it: its id is not reused)
            return self._summed[id(b)][1]
        if b.axis == PARTIAL:
            out = jax.lax.psum(b.value, self.axis_name)
        elif math.prod(_shape(var)) <= self.small:
            out = jax.lax.all_gather(b.value, self.axis_name, axis=b.axis, tiled=True)
        else:
            raise NotBlockable(f"a value of shape {_shape(var)} would be gathered whole")
        self._summed[id(b)] = (b, out)
        return out

    def cut(self, x: Any, axis: int) -> Any:
        """This device's block along ``axis`` of the whole value ``x``."""
        if x.shape[axis] % self.num_shards:
            raise NotBlockable(f"axis {axis} of {x.shape} does not divide by the devices")
        size = x.shape[axis] // self.num_shards
        start = jax.lax.axis_index(self.axis_name) * size
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    def along(self, b: Block, var: Any, axis: int | None) -> Any:
        """``b`` as this device's block along ``axis`` (``None``: whole)."""
        if b.axis == axis:
            return b.value
        x = self.whole(b, var)
        return x if axis is None else self.cut(x, axis)

    # The evaluation.

    def evaluate(self, closed: Any, ins: list, program: Program = ()) -> list:
        """The outputs of a (closed) jaxpr on ``ins`` (arrays, or :class:`Block`): each a
        :class:`Block`. ``program``: the sums of :mod:`zeroshard.core.sums` per equation,
        applied where no block is involved (none inside loops)."""
        sums = iter(program)
        ins = [x if isinstance(x, Block) else Block(x, None) for x in ins]
        outs = walk(closed, ins, lambda eqn, xs: self._eqn(eqn, next(sums, None), xs))
        return [x if isinstance(x, Block) else Block(x, None) for x in outs]

    def _eqn(self, eqn: Any, sums: Sums | None, xs: list) -> list[Block]:
        xs = [x if isinstance(x, Block) else Block(x, None) for x in xs]
        if all(x.axis is None for x in xs):
            values = [x.value for x in xs]  # (loops and collectives: typed as traced)
            values = self.typed(values) if eqn.primitive.name in _TYPED else values
            return [Block(y, None) for y in bound(eqn, sums, values, self.axis_name)]
        if sums is not None:
            raise NotBlockable("a sum over sliced leaves meets a blocked value")
        name = eqn.primitive.name
        if name in PASS_THROUGH:
            return xs[: len(eqn.outvars)]
        if name == "scan":
            return self._scan(eqn, xs)
        rule = _RULES.get(name, _elementwise if name in ELEMENTWISE else None)
        if rule is None:
            raise NotBlockable(f"`{name}` on a blocked value")
        return rule(self, eqn, xs)

    def typed(self, values: list) -> list:
        """``values`` typed varying over the axis alike, where some are (a whole value
        computed here, by a ``psum``, meeting a block or a sliced leaf's piece)."""
        varying = [varies(x, self.axis_name) for x in values]
        if any(varying) and not all(varying):
            return [vary(x, self.axis_name) for x in values]
        return values

    def bind(self, eqn: Any, values: list, **params: Any) -> list:
        """``eqn``'s primitive bound on ``values`` (typed alike, see :meth:`typed`)."""
        ys = eqn.primitive.bind(*self.typed(values), **{**eqn.params, **params})
        return list(ys) if eqn.primitive.multiple_results else [ys]

    def _scan(self, eqn: Any, xs: list[Block]) -> list[Block]:
        """A ``scan`` with blocked constants or carries, its body evaluated on blocks. The
        carries keep the form they enter in; one entering whole that leaves as a block
        is cut to that form before the loop (and the loop traced again)."""
        consts, carry, scanned = scan_parts(eqn, list(range(len(xs))))
        if any(xs[k].axis is not None for k in scanned):
            raise NotBlockable("a scan over blocked inputs")
        body, params = eqn.params["jaxpr"], eqn.params
        outvars = open_jaxpr(body).outvars
        axes = [None if xs[k].axis == PARTIAL else xs[k].axis for k in carry]
        for _ in range(len(carry) + 1):
            found: list = []

            def step(c, x, axes=axes, found=found):
                ins = [xs[k] for k in consts] + [Block(v, a) for v, a in zip(c, axes, strict=True)]
                outs = Evaluator(self.axis_name, self.num_shards, self.small).evaluate(
                    body, ins + [Block(v, None) for v in x]
                )
                found[:] = [o.axis for o in outs[: len(carry)]]
                new = [
                    self.along(o, outvars[j], a)
                    for j, (o, a) in enumerate(zip(outs, axes, strict=False))
                ]
                ys = [self.whole(o, outvars[j]) for j, o in enumerate(outs) if j >= len(carry)]
                return new, ys

            init = [self.along(xs[k], eqn.invars[k], a) for k, a in zip(carry, axes, strict=True)]
            loop = dict(length=params["length"], reverse=params["reverse"], unroll=params["unroll"])
            c, ys = jax.lax.scan(step, init, [xs[k].value for k in scanned], **loop)
            grown = [
                f if a is None and isinstance(f, int) else a
                for a, f in zip(axes, found, strict=True)
            ]
            if grown == axes:
                return [Block(v, a) for v, a in zip(c, axes, strict=True)] + [
                    Block(y, None) for y in ys
                ]
            axes = grown
        raise NotBlockable("a scan's carries change form every iteration")


@dataclasses.dataclass(frozen=True)
class At:
    """Where a blocked leaf lies: this device's block of ``full`` along ``axis``
    (gathered whole before the evaluation where ``gathered``)."""

    axis: int
    full: jax.ShapeDtypeStruct
    gathered: bool = False


def run_blocked(
    fn: Any,
    args: tuple,
    marks: tuple,
    out_marks: Any,
    axis_name: str,
    num_shards: int,
    tags: Any = None,
    forms: list | None = None,
) -> Any:
    """``fn(*args)`` where some leaves of ``args`` are blocks (``marks``: a tree like
    ``args`` with an :class:`At` there, ``None`` elsewhere): traced with those leaves at
    their full shape and evaluated on the blocks (:class:`Evaluator`). ``out_marks``
    (a function of the output's shape tree) marks the outputs to return as blocks;
    the others are returned whole. ``tags``: ``(in_tags, leaf_names, sliced)`` for
    the sums over the sliced leaves (:func:`zeroshard.core.sums.run_with_sums`), if any.
    ``forms``, if given, receives the form (:attr:`Block.axis`) each output had
    (with ``out_marks`` ``None``, the outputs are returned as they are, in a list).

    Raises:
      NotBlockable: where the traced computation cannot be followed on blocks.
    """
    treedef = jax.tree.structure(args)
    values, at = jax.tree.leaves(args), treedef.flatten_up_to(marks)
    traced = treedef.unflatten(x if m is None else m.full for x, m in zip(values, at, strict=True))
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*traced)
    program = () if tags is None else Tagger(axis_name, tags[1], tags[2]).run(closed, tags[0])[1]
    small = max(max(m.full.shape) for m in at if m is not None)
    ev = Evaluator(axis_name, num_shards, small)
    gather = lambda x, m: jax.lax.all_gather(x, axis_name, axis=m.axis, tiled=True)
    ins = [
        x if m is None else Block(gather(x, m), None) if m.gathered else Block(x, m.axis)
        for x, m in zip(values, at, strict=True)
    ]
    outs = ev.evaluate(closed, ins, program)
    if forms is not None:
        forms.extend(o.axis for o in outs)
    if out_marks is None:  # (a probe: the outputs as they are)
        return [o.value for o in outs]
    out_def = jax.tree.structure(out_shape)
    wanted = out_def.flatten_up_to(out_marks(out_shape))
    outvars = open_jaxpr(closed).outvars
    got = [
        ev.along(o, v, None if m is None else m.axis)
        for o, v, m in zip(outs, outvars, wanted, strict=True)
    ]
    return out_def.unflatten(got)


def blockable(
    inner: Any,
    params: Any,
    state: Any,
    leaf: int,
    axis: int,
    analysis: Any,
    axis_name: str,
    num_shards: int,
) -> tuple[dict[int, int], frozenset[int]] | None:
    """Whether ``inner``'s update and init of leaf ``leaf`` of ``params`` (full
    ``ShapeDtypeStruct`` leaves; ``state``: the full state) run exactly on its blocks
    along ``axis`` on ``num_shards`` devices (``analysis``: what
    :func:`zeroshard.analysis.analyze` found). ``None`` if not; else, for each of the
    leaf's state leaves kept as blocks, the axis (the one the update computes it
    along; else, for one it computes whole, its first axis that divides by the
    devices), and which of them the update reads whole (gathered before it)."""
    p_leaves, p_def = jax.tree.flatten(params)
    s_leaves, s_def = jax.tree.flatten(state)
    extra, n = analysis.stand_ins(), num_shards
    mine = [k for k, j in enumerate(analysis.state_leaves) if j == leaf]

    def marks(store: dict[int, int], gathered: Any) -> tuple:
        p = p_def.unflatten(At(axis, x) if i == leaf else None for i, x in enumerate(p_leaves))
        s = s_def.unflatten(
            At(store[k], x, k in gathered) if k in store else None for k, x in enumerate(s_leaves)
        )
        return p, s, p, jax.tree.map(lambda _: None, extra)

    def block(x: Any, m: Any) -> Any:
        shape = x.shape if m is None else _divided(m.full.shape, m.axis, n)
        return jax.ShapeDtypeStruct(shape, x.dtype)

    def probe(store: dict[int, int], gathered: Any, forms: list | None = None) -> None:
        mk = marks(store, gathered)
        args = jax.tree.map(block, (params, state, params, extra), mk)
        fn = lambda g, s, p, e: inner.update(g, s, p, **e)
        out = None if forms is not None else lambda _: mk[:2]
        run = lambda *a: run_blocked(fn, a, mk, out, axis_name, n, None, forms)
        jax.make_jaxpr(run, axis_env=axis_env(axis_name, n))(*args)
        init = lambda p: run_blocked(inner.init, (p,), (mk[0],), lambda _: mk[1], axis_name, n)
        jax.make_jaxpr(init, axis_env=axis_env(axis_name, n))(args[0])

    divides = {k: _divides(s_leaves[k].shape, n) for k in mine}
    try:
        forms: list = []
        probe({k: d for k, d in divides.items() if d is not None}, mine, forms)
        if forms[leaf] != axis:  # its update is not computed block by block
            return None
        out = forms[len(p_leaves) :]
        store = {k: out[k] if isinstance(out[k], int) else divides[k] for k in mine}
        store = {k: d for k, d in store.items() if d is not None}
        gathered = frozenset(k for k in store if out[k] != store[k])
        probe(store, gathered)
    except NotBlockable:
        return None
    return store, gathered


def to_columns(rows: jax.Array, axis_name: str) -> jax.Array:
    """This device's block of columns of a matrix, from every device's block of rows
    (``rows``: this device's): one ``all_to_all``."""
    n = jax.lax.axis_size(axis_name)
    r, c = rows.shape
    parts = rows.reshape(r, n, c // n)
    return jax.lax.all_to_all(parts, axis_name, 1, 0, tiled=True).reshape(r * n, c // n)


def to_rows(columns: jax.Array, axis_name: str) -> jax.Array:
    """The inverse of :func:`to_columns`: this device's block of rows."""
    return jax.lax.all_to_all(columns, axis_name, 0, 1, tiled=True)


@dataclasses.dataclass(frozen=True)
class Blocked:
    """A blocked leaf's placement: a 2-D leaf cut as a sliced one (its rows divide by
    the devices, so each piece is a block of whole rows), whose whole-tensor update
    runs on every device's block along ``axis``; along axis 1 each device's block of
    columns is exchanged with the pieces by ``all_to_all`` around its update. Chosen
    by :func:`zeroshard.core.placement.make_plan` where :func:`blockable` finds the update
    exact on the blocks.

    Attributes:
      axis: the axis the blocks are cut along.
    """

    axis: int

    def mark(self, struct: Any) -> At:
        """Where the leaf's block lies in the traced update's arguments."""
        return At(self.axis, struct)

    def to_view(self, rows: jax.Array, axis_name: str) -> jax.Array:
        """This device's block as its update sees it, from its piece's ``rows``."""
        return rows if self.axis == 0 else to_columns(rows, axis_name)

    def from_view(self, block: jax.Array | None, axis_name: str) -> jax.Array | None:
        """The inverse of :meth:`to_view`: the piece's rows again."""
        return block if block is None or self.axis == 0 else to_rows(block, axis_name)


def to_pieces(slots: Any, leaves: list, axis_name: str) -> list:
    """Per-leaf values shaped as the inner optimizer sees them, with the blocked
    leaves' blocks (``slots``: the leaves' layout slots) sent back as the pieces'
    rows (:meth:`Blocked.from_view`)."""
    back = lambda s, x: s.block.from_view(x, axis_name) if s.blocked else x
    return [back(s, x) for s, x in zip(slots, leaves, strict=True)]


def init_blocked(inner: Any, view: Any, marks: tuple, axis_name: str, num_shards: int) -> Any:
    """``inner.init`` on a view with blocked leaves (``marks``: where the blocks lie in
    ``(params, state)``, as :meth:`zeroshard.core.placement.Plan.block_marks` gives them)."""
    return run_blocked(inner.init, (view,), (marks[0],), lambda _: marks[1], axis_name, num_shards)


def _divides(shape: tuple[int, ...], n: int) -> int | None:
    return next((k for k, d in enumerate(shape) if d > 0 and d % n == 0), None)


def _divided(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], shape[axis] // n, *shape[axis + 1 :])


def _shape(var: Any) -> tuple[int, ...]:
    return tuple(var.aval.shape) if isinstance(var, jex_core.Var | jex_core.Literal) else ()


def _kinds(xs: list[Block]) -> list[str]:
    return ["P" if x.axis == PARTIAL else "C" if x.axis is None else "S" for x in xs]


def _linear(name: str, kinds: list[str]) -> bool:
    """Whether ``name`` on operands of ``kinds`` is linear in its partial ones."""
    if "S" in kinds or "P" not in kinds:
        return False
    if name in _UNARY:
        return len(kinds) == 1
    if name == "mul":
        return kinds.count("P") == 1
    if name == "div":
        return kinds == ["P", "C"]
    return name in ("add", "sub") and set(kinds) == {"P"}


def _elementwise(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    """Operands of one shape (or broadcast from size one): the blocks' axis, the whole
    operands cut along it (where two axes meet, the larger value's; the other value
    gathered whole, if small)."""
    name, kinds = eqn.primitive.name, _kinds(xs)
    if _linear(name, kinds):
        return [Block(y, PARTIAL) for y in ev.bind(eqn, [x.value for x in xs])]
    sized = lambda k, v: len(_shape(v)) > k and _shape(v)[k] > 1
    blocks = [(math.prod(_shape(v)), x.axis) for x, v in _pairs(eqn, xs) if isinstance(x.axis, int)]
    blocks = [(n, a) for n, a in blocks if any(sized(a, v) for v in eqn.invars)]
    if not blocks:  # partial sums only, or blocks broadcast from one element
        return _whole(ev, eqn, xs)
    axis = max(blocks, key=lambda b: (b[0], -b[1]))[1]
    values = [
        ev.along(x, v, axis) if sized(axis, v) else ev.whole(x, v) for x, v in _pairs(eqn, xs)
    ]
    return [Block(y, axis) for y in ev.bind(eqn, values)]


def _pairs(eqn: Any, xs: list[Block]) -> list[tuple[Block, Any]]:
    return list(zip(xs, eqn.invars, strict=True))


def _blocked_shape(ev: Evaluator, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    if shape[axis] % ev.num_shards:
        raise NotBlockable(f"axis {axis} of {shape} does not divide by the devices")
    return (*shape[:axis], shape[axis] // ev.num_shards, *shape[axis + 1 :])


def _broadcast_in_dim(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    x, dims, shape = xs[0], eqn.params["broadcast_dimensions"], tuple(eqn.params["shape"])
    if x.axis == PARTIAL or len(xs) > 1:
        return _whole(ev, eqn, xs, PARTIAL if x.axis == PARTIAL and len(xs) == 1 else None)
    if _shape(eqn.invars[0])[x.axis] == 1:
        return _whole(ev, eqn, xs)
    out = dims[x.axis]
    return [Block(ev.bind(eqn, [x.value], shape=_blocked_shape(ev, shape, out))[0], out)]


def _whole(ev: Evaluator, eqn: Any, xs: list[Block], keep: Any = None) -> list[Block]:
    """``eqn`` on whole operands (a partial one kept partial where ``keep``)."""
    values = [x.value if keep == PARTIAL else ev.whole(x, v) for x, v in _pairs(eqn, xs)]
    return [Block(y, keep) for y in ev.bind(eqn, values)]


def _reshape(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    x = xs[0]
    if x.axis == PARTIAL:
        return _whole(ev, eqn, xs, PARTIAL)
    old, new = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    k = x.axis
    for j in range(len(new)):
        if new[j] == old[k] and math.prod(new[:j]) == math.prod(old[:k]):
            sizes = _blocked_shape(ev, new, j)
            return [Block(ev.bind(eqn, [x.value], new_sizes=sizes)[0], j)]
    return _whole(ev, eqn, xs)


def _squeeze(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    x = xs[0]
    if x.axis == PARTIAL:
        return _whole(ev, eqn, xs, PARTIAL)
    dims = [d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"]]
    return [Block(ev.bind(eqn, [x.value])[0], x.axis - sum(d < x.axis for d in dims))]


def _transpose(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    x = xs[0]
    if x.axis == PARTIAL:
        return _whole(ev, eqn, xs, PARTIAL)
    return [Block(ev.bind(eqn, [x.value])[0], tuple(eqn.params["permutation"]).index(x.axis))]


def _reduce(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    x, name = xs[0], eqn.primitive.name
    axes = tuple(eqn.params["axes"])
    if x.axis == PARTIAL:
        return _whole(ev, eqn, xs, PARTIAL if name == "reduce_sum" else None)
    (y,) = ev.bind(eqn, [x.value])
    if x.axis not in axes:
        return [Block(y, x.axis - sum(a < x.axis for a in axes))]
    if name == "reduce_sum":
        return [Block(y, PARTIAL)]
    combine = {"reduce_max": jax.lax.pmax, "reduce_min": jax.lax.pmin}[name]
    return [Block(combine(y, ev.axis_name), None)]


def _dot_general(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    """A block contracted: a partial product; a block along a batch or free axis: the
    product's block along it. The other operand is cut to match (or, where it is a
    block along another axis, gathered whole if small)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lv, rv = eqn.invars
    lhs, rhs = [Block(ev.whole(x, v), None) if x.axis == PARTIAL else x for x, v in _pairs(eqn, xs)]
    free_l = [d for d in range(len(_shape(lv))) if d not in (*lc, *lb)]
    free_r = [d for d in range(len(_shape(rv))) if d not in (*rc, *rb)]
    if isinstance(lhs.axis, int):
        other, out = _matched(lhs.axis, (lc, lb), (rc, rb), free_l, len(lb))
        return [Block(ev.bind(eqn, [lhs.value, ev.along(rhs, rv, other)])[0], out)]
    if isinstance(rhs.axis, int):
        other, out = _matched(rhs.axis, (rc, rb), (lc, lb), free_r, len(lb) + len(free_l))
        return [Block(ev.bind(eqn, [ev.along(lhs, lv, other), rhs.value])[0], out)]
    return _whole(ev, eqn, [lhs, rhs])


def _matched(k: int, mine: tuple, theirs: tuple, free: list[int], offset: int) -> tuple:
    """For one operand of a product blocked along its axis ``k`` (``mine``, ``theirs``:
    the contracting and batch axes of it and of the other operand; ``free``: its free
    axes, the first at output axis ``offset``): the axis to cut the other operand along
    (``None``: whole) and the output's form."""
    (contract, batch), (other_contract, other_batch) = mine, theirs
    if k in contract:
        return other_contract[contract.index(k)], PARTIAL
    if k in batch:
        return other_batch[batch.index(k)], batch.index(k)
    return None, offset + free.index(k)


def _slice(ev: Evaluator, eqn: Any, xs: list[Block]) -> list[Block]:
    x = xs[0]
    if x.axis == PARTIAL:
        return _whole(ev, eqn, xs)
    full = _shape(eqn.invars[0])
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params.get("strides") or (1,) * len(full)
    k = x.axis
    if start[k] != 0 or limit[k] != full[k] or strides[k] != 1:
        return _whole(ev, eqn, xs)
    limit = (*limit[:k], full[k] // ev.num_shards, *limit[k + 1 :])
    return [Block(ev.bind(eqn, [x.value], limit_indices=limit)[0], k)]


_RULES: dict[str, Any] = {
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "transpose": _transpose,
    "reduce_sum": _reduce,
    "reduce_max": _reduce,
    "reduce_min": _reduce,
    "dot_general": _dot_general,
    "slice": _slice,
}
# Typed alike here: a whole value computed from blocks is invariant where it was traced
# varying, or the other way round (loops, conditionals and collectives are bound as
# :mod:`zeroshard.core.sums` types them, as traced).
_TYPED = ELEMENTWISE | frozenset(_RULES)
