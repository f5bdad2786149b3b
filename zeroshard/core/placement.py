"""Placement: each leaf's placement, what each device's inner optimizer sees, where its state lives.

Built once per parameter layout, at trace time, from shapes alone:

1. :func:`zeroshard.analysis.analyze` traces the inner update and finds the leaves whose
   update needs more than their elements and sums over them; they (and any the user
   forces) are *owned*, whole or, for stacked layers updated separately, layer by
   layer; the others are *sliced* (:mod:`zeroshard.core.layout` places them, balancing the
   owned units over the devices). The largest of those units, where one device would
   run and keep more than its share, are *blocked* instead where their update runs
   exactly on blocks of rows or columns (:mod:`zeroshard.core.blocks`): sliced, with the
   whole-tensor update evaluated on every device's block and its state in blocks.
2. Devices owning the same number of units of the same leaves share a *branch*. On
   branch ``b`` the inner optimizer sees its *view* of the parameters: a slice of
   every sliced leaf, the whole of each leaf the branch owns (its layers, stacked, of
   a layer-owned leaf), and a stand-in (a single zero of the leaf's rank) for every
   other owned leaf. Every device runs one program: a ``lax.switch`` on its branch
   (:mod:`zeroshard.core.branches`).
3. Each leaf of the inner state is classified: *sliced* (per-element, like its
   leaf's slices), *replicated* (counts, hyperparameters) or *owned* (belongs to an
   owned leaf, or differs between views). Owned state, and the master weights of
   owned leaves, live in :class:`Storage` rows: one per dtype and device, padded to
   the most loaded device.
4. On more than one device, sliced leaves whose elementwise update is the same
   computation on pieces of the same shape form a *group* (:attr:`Plan.groups`): their
   pieces lie end to end in the first leaf's place, in the view, the state and the
   master weights, so the inner optimizer runs once per group (the compiled step has
   one fused update per group instead of one per leaf). Every element is computed as
   before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroshard.analysis import (
    Analysis,
    NotElementwiseError,
    analyze,
    input_names,
    leaf_forms,
    trace_update,
)
from zeroshard.communication.collectives import vary
from zeroshard.core.blocks import At, Blocked, blockable, run_blocked
from zeroshard.core.layout import Layout, PyTree, is_floating
from zeroshard.core.rows import pack, unpack
from zeroshard.core.state_kinds import BlockedState, OwnedState, ReplicatedState, SlicedState
from zeroshard.core.sums import PSUM, Psum, run_with_sums

Key = tuple[str, int]
"""A storage entry: ``("state", k)`` for leaf ``k`` of the inner state, ``("master",
i)`` for the master weights of owned leaf ``i``."""


@dataclasses.dataclass(frozen=True)
class Storage:
    """Per-device rows holding what only a leaf's owner keeps.

    Attributes:
      dtypes: the dtype of each row.
      widths: the elements of each row (those of the most loaded branch).
      entries: per branch, ``(key, row, offset, shape)`` of each value it stores.
    """

    dtypes: tuple[np.dtype, ...]
    widths: tuple[int, ...]
    entries: tuple[tuple[tuple[Key, int, int, tuple[int, ...]], ...], ...]

    @classmethod
    def build(cls, per_branch: list[list[tuple[Key, jax.ShapeDtypeStruct]]]) -> Storage:
        dtypes = tuple(dict.fromkeys(np.dtype(x.dtype) for v in per_branch for _, x in v))
        entries, ends = [], []
        for values in per_branch:
            out, used = [], [0] * len(dtypes)
            for key, struct in values:
                r = dtypes.index(np.dtype(struct.dtype))
                out.append((key, r, used[r], tuple(struct.shape)))
                used[r] += math.prod(struct.shape)
            entries.append(tuple(out))
            ends.append(used)
        return cls(dtypes, tuple(max(w) for w in zip(*ends, strict=True)), tuple(entries))

    def find(self, branch: int, key: Key) -> tuple[int, int, tuple[int, ...]]:
        """``(row, offset, shape)`` of ``key`` on ``branch``."""
        return next(e[1:] for e in self.entries[branch] if e[0] == key)

    def unpack(self, rows: tuple[jax.Array, ...], branch: int) -> dict[Key, jax.Array]:
        """The values ``branch`` stores, from its rows (the inverse of :meth:`pack`)."""
        return {key: unpack(rows[r], [shape], o)[0] for key, r, o, shape in self.entries[branch]}

    def pack(self, values: dict[Key, jax.Array], branch: int) -> tuple[jax.Array, ...]:
        """``branch``'s rows: per dtype its values end to end, padded to the widest."""
        parts: list[list[jax.Array]] = [[] for _ in self.dtypes]
        for key, r, _, _ in self.entries[branch]:
            parts[r].append(values[key])
        return tuple(pack(p, d, w) for d, w, p in zip(self.dtypes, self.widths, parts, strict=True))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one parameter tree needs, fixed at trace time.

    Attributes:
      layout: the parameters' layout over ``num_shards`` devices, with placements.
      master_dtypes: per bucket, the dtype of the master weights kept in the state,
        or ``None`` where the parameters themselves are precise enough.
      branches: per branch, the owned leaves its devices hold and how many units of
        each (:meth:`zeroshard.core.layout.Layout.profile`).
      branch_of: per device, its branch.
      state_treedef: the inner state's tree structure.
      analysis: what :func:`zeroshard.analysis.analyze` found in the traced update.
      state_kinds: per leaf of the inner state, its record: where it lives, its full
        shape and dtype, and how it is stored (:mod:`zeroshard.core.state_kinds`).
      storage: where owned state and owned master weights live.
      groups: the sliced leaves updated as one buffer (:func:`_groups`): per group its
        leaves, whose pieces are laid end to end, in the first one's place, in the
        view, the state and the master weights (``None`` at the others').
      order: the order of the sums in the update, bound to the layout's leaves
        (:class:`zeroshard.core.sums.Psum`).
      holes: whether the inner optimizer takes trees with ``None`` at the hidden
        leaves (and their state) and computes the others as it does with every leaf
        present; else the hidden leaves are zero-element arrays.
      updates: per inner optimizer and axis, :meth:`updates_and_state` jitted (its
        traces cached).
    """

    layout: Layout
    master_dtypes: tuple[Any, ...]
    branches: tuple[tuple[tuple[int, int], ...], ...]
    branch_of: tuple[int, ...]
    state_treedef: Any
    analysis: Analysis
    state_kinds: tuple[ReplicatedState, ...] = ()
    storage: Storage = Storage((), (), ())
    groups: tuple[tuple[int, ...], ...] = ()
    order: Psum = PSUM
    holes: bool = False
    updates: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def inner_dtypes(self) -> list[Any]:
        """Dtype the inner optimizer works in, per bucket."""
        return [m or b.dtype for m, b in zip(self.master_dtypes, self.layout.buckets, strict=True)]

    def master_tree(self, pieces: list[Any]) -> PyTree:
        """The state's ``master``: a tree like the parameters with ``pieces[i]`` (an array
        shaped as the leaf's piece, its last axis holding its group's pieces where it
        is a group's first leaf; or any other value as it is, e.g. a
        ``PartitionSpec``) where leaf ``i`` keeps master weights, ``None`` elsewhere;
        ``None`` as a whole when no leaf keeps any."""
        # Owned leaves keep their master weights in storage.
        keeps = [
            not s.owned and i not in self.hidden and self.master_dtypes[s.bucket] is not None
            for i, s in enumerate(self.layout.slots)
        ]
        if not any(keeps):
            return None
        shaped = lambda p, s: p.reshape(*s.piece_shape[:-1], -1) if isinstance(p, jax.Array) else p
        leaves = zip(pieces, keeps, self.layout.slots, strict=True)
        return self.layout.treedef.unflatten(shaped(p, s) if k else None for p, k, s in leaves)

    @functools.cached_property
    def on_view(self) -> Grouping:
        """How the view and the master pieces hold :attr:`groups`."""
        return Grouping(self.layout.treedef, self.groups, self.holes)

    @functools.cached_property
    def on_state(self) -> Grouping:
        """How the inner state holds its leaves of :attr:`groups`: a group per state
        role (``mu``, ``nu``, ...), its leaves' state leaves in the same order."""
        own = lambda i: [k for k, x in enumerate(self.state_kinds) if getattr(x, "leaf", -1) == i]
        groups = tuple(ks for g in self.groups for ks in zip(*map(own, g), strict=True))
        return Grouping(self.state_treedef, groups, self.holes)

    @property
    def hidden(self) -> frozenset[int]:
        """The grouped leaves whose pieces are in another leaf's place."""
        return self.on_view.hidden

    @functools.cached_property
    def leaf_order(self) -> tuple[int, ...]:
        """The leaves in order, each group's together at its first leaf's place: the
        order packed collectives lay pieces out in, so that a group's pieces are
        neighbours in a packed row (grouping them there is a slice, not a copy)."""
        first = {g[0]: g for g in self.groups}
        order = (first.get(i, (i,)) for i in range(len(self.layout.slots)) if i not in self.hidden)
        return tuple(i for g in order for i in g)

    def updates_and_state(
        self,
        inner: Any,
        grads: PyTree,
        state: PyTree,
        params: PyTree,
        axis_name: str,
        **extra_args: Any,
    ) -> tuple[PyTree, PyTree]:
        """``inner.update`` on a view: its updates and new state, with global sums over
        ``axis_name`` inserted where the analysis found them
        (:func:`zeroshard.core.sums.run_with_sums`). Traced, tagged and evaluated once per
        ``inner``, axis and type of the arguments: a later trace of a step reuses it
        (``jax.jit``'s cache, inlined into the step)."""
        args = (grads, state, params, extra_args)
        if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(extra_args)):
            return self._updates_and_state(inner, axis_name, *args)  # e.g. a function: as it is
        key = (id(inner), axis_name)
        if self.updates.get(key, (None,))[0] is not inner:
            run = functools.partial(self._updates_and_state, inner, axis_name)
            self.updates[key] = (inner, jax.jit(run, inline=True))
        return self.updates[key][1](*args)

    def _updates_and_state(self, inner, axis_name, grads, state, params, extra_args):
        slots, sums = self.layout.slots, self.analysis.layer_sums
        sliced = {  # the leaves whose sums are partial here (a group's: its buffer's)
            i: Joined(tuple(slots[j] for j in g)) for g in self.groups for i in g[:1]
        }
        sliced |= {
            i: s
            for i, s in enumerate(slots)
            if (not s.owned and not s.blocked and i not in sliced) or (i in sums and s.layered)
        }
        order = self.order
        partial = any(len(x) > 1 or x & sliced.keys() for x in self.analysis.sums)
        if not (order.rewrites or sums or partial or self.layout.blocked):
            return inner.update(grads, state, params, **extra_args)
        fn = lambda g, s, p, e: inner.update(g, s, p, **e)
        present = [i for i in range(len(slots)) if not (self.holes and i in self.hidden)]
        kept = [
            k
            for k in range(len(self.state_kinds))
            if not self.holes or k not in self.on_state.hidden
        ]
        tags = self.analysis.in_tags(present, kept)  # the extra arguments: clean
        args, names = (grads, state, params, extra_args), [s.path for s in slots]
        if self.layout.blocked:  # evaluated on the blocks (zeroshard.core.blocks), with the sums
            marks = self.block_marks(extra_args)
            out, n = (lambda _: marks[:2]), self.layout.num_shards
            return run_blocked(fn, args, marks, out, axis_name, n, (tags, names, sliced))
        return run_with_sums(fn, args, tags, axis_name, names, sliced, order)

    def block_marks(self, extra_args: dict | None = None) -> tuple:
        """Where the blocks lie in the arguments of ``inner.update(grads, state, params,
        **extra_args)`` (:func:`zeroshard.core.blocks.run_blocked`): the blocked leaves'
        blocks of rows or columns, and their state leaves kept as blocks
        (:class:`zeroshard.core.state_kinds.BlockedState`)."""
        full = lambda s: jax.ShapeDtypeStruct(s.shape, self.inner_dtypes[s.bucket])
        leaves = [s.block.mark(full(s)) if s.blocked else None for s in self.layout.slots]
        params = self.layout.treedef.unflatten(leaves)
        state = self.state_treedef.unflatten(
            At(x.axis, x.struct, x.gathered) if isinstance(x, BlockedState) else None
            for x in self.state_kinds
        )
        return params, state, params, jax.tree.map(lambda _: None, extra_args or {})

    def local_wholes(self, branch: int, wholes: list, axis_name: str) -> list:
        """What this device, on ``branch``, holds of the full owned leaves ``wholes``:
        the leaves it owns whole, the layers it owns of layer-owned ones (``None``
        elsewhere)."""
        index = jax.lax.axis_index(axis_name)
        return self.in_branch(branch, lambda i, s, count: s.local(wholes[i], index, count))

    def in_branch(self, branch: int, fn: Any) -> list:
        """``fn(i, slot, count)`` for each owned leaf ``i`` that ``branch`` holds (whole,
        or ``count`` of its layers), ``None`` for every other leaf."""
        owned = dict(self.branches[branch])
        return [fn(i, s, owned[i]) if i in owned else None for i, s in enumerate(self.layout.slots)]

    def view(self, branch: int, pieces: list, local: list, axis_name: str) -> PyTree:
        """The tree branch ``branch``'s inner optimizer sees: ``pieces[i]`` (grouped,
        shaped as the leaf's piece, its last axis holding its group's pieces where it
        is a group's first leaf) for a sliced leaf (``None`` for a hidden one:
        see :meth:`filled`), ``local[i]`` (see :meth:`local_wholes`) for a leaf it
        owns, a one-element stand-in for any other owned leaf."""
        dtypes, owned = self.inner_dtypes, dict(self.branches[branch])
        stand_in = lambda s: _empty(s.stand_in_shape, dtypes[s.bucket], axis_name)

        def piece(i: int, s: Any) -> Any:
            if i in self.hidden:
                return None
            if not s.blocked:
                return pieces[i].reshape(*s.piece_shape[:-1], -1)
            rows = pieces[i].reshape(s.shape[0] // s.num_shards, *s.shape[1:])
            return s.block.to_view(rows, axis_name)

        leaves = [
            local[i] if i in owned else stand_in(s) if s.owned else piece(i, s)
            for i, s in enumerate(self.layout.slots)
        ]
        return self.layout.treedef.unflatten(leaves)

    def view_structs(self, branch: int, longer: bool = False, holes: bool = False) -> PyTree:
        """``ShapeDtypeStruct``s of branch ``branch``'s view, leaf by leaf (sliced pieces
        one element longer with ``longer``: a probe of which state leaves are
        per-element; ``None`` at the hidden leaves with ``holes``)."""
        dtypes, owned = self.inner_dtypes, dict(self.branches[branch])

        def struct(i, s):
            if holes and i in self.hidden:
                return None
            if s.blocked:  # traced whole (see zeroshard.core.blocks)
                shape = s.shape
            elif not s.owned:
                shape = (*s.piece_shape[:-1], s.piece_shape[-1] + longer)
            else:
                shape = s.local_shape(owned[i]) if i in owned else s.stand_in_shape
            return jax.ShapeDtypeStruct(shape, dtypes[s.bucket])

        return self.layout.treedef.unflatten(struct(i, s) for i, s in enumerate(self.layout.slots))

    def owned_bytes(self) -> list[int]:
        """Per device, the bytes of the owned leaves' state and master it keeps (without
        the rows' padding)."""
        nbytes = lambda entry: math.prod(entry[3]) * self.storage.dtypes[entry[1]].itemsize
        return [sum(map(nbytes, self.storage.entries[b])) for b in self.branch_of]

    def owned_costs(self) -> list[float]:
        """Per device, the summed update cost of the leaves (and layers) it owns, and its
        share of the blocked leaves'."""
        slots, matrix = self.layout.slots, self.analysis.matrix
        cost = lambda i, count: leaf_cost(slots[i], i in matrix) * count / len(slots[i].owners)
        blocked = sum(leaf_cost(slots[i], i in matrix) for i in self.layout.blocked) / len(
            self.branch_of
        )
        owned = [sum(cost(i, count) for i, count in self.branches[b]) for b in self.branch_of]
        return [c + blocked for c in owned]


RUNTIME_OFFSETS = jax.__version_info__ >= (0, 12)
"""Whether :meth:`Grouping.ungrouped` slices a group's buffer at offsets given at run
time (see there)."""


@dataclasses.dataclass(frozen=True)
class Grouping:
    """How one tree (a view of the parameters, or the inner state) holds groups of
    leaves updated as one buffer (:attr:`Plan.groups`): each group's leaves laid end
    to end in its first leaf's place, the others *hidden* (``None``). A group's
    leaves are alike (:func:`zeroshard.analysis.groups.leaf_forms`: the same
    computation on values of one shape and dtype), so each is shaped as the first.

    Attributes:
      treedef: the tree's structure.
      groups: the groups, by leaf index.
      holes: whether the inner optimizer takes the tree with ``None`` at the hidden
        leaves (:attr:`Plan.holes`).
    """

    treedef: Any
    groups: tuple[tuple[int, ...], ...]
    holes: bool

    @functools.cached_property
    def hidden(self) -> frozenset[int]:
        """The grouped leaves whose values are in another leaf's place."""
        return frozenset(i for g in self.groups for i in g[1:])

    def grouped(self, leaves: list) -> list:
        """Per-leaf values with each group's laid end to end in its first leaf's place
        (shaped as the first but for the last axis, which holds them all) and ``None``
        at its other leaves'."""
        out = list(leaves)
        for g in self.groups:
            joined = jnp.concatenate([jnp.ravel(leaves[i]) for i in g])
            out[g[0]] = joined.reshape(*leaves[g[0]].shape[:-1], -1)
            for i in g[1:]:
                out[i] = None
        return out

    def runs(self, leaves: list, order: Sequence[int]) -> list[tuple[tuple[int, ...], Any]]:
        """The values of the leaves ``order`` (held as :meth:`grouped` holds them) in
        runs: each run of a group's leaves, consecutive there as in ``order``, one
        slice of the group's buffer; any other leaf alone, as it is. A collective
        that packs them then moves the buffer with no copy per leaf."""
        where = {i: (g, k) for g in self.groups for k, i in enumerate(g)}
        runs: list[list[int]] = []
        for i in order:
            last = runs[-1][-1] if runs else None
            if i in where and last in where and where[last] == (where[i][0], where[i][1] - 1):
                runs[-1].append(i)
            else:
                runs.append([i])

        def value(run: list[int]) -> Any:
            if run[0] not in where:
                return leaves[run[0]]
            (g, k), flat = where[run[0]], jnp.ravel(leaves[where[run[0]][0][0]])
            width = flat.shape[0] // len(g)
            return flat if len(run) == len(g) else flat[k * width : (k + len(run)) * width]

        return [(tuple(run), value(run)) for run in runs]

    def each(self, fn: Any, leaves: list) -> list:
        """``fn`` of each leaf's value (``None`` where it has none), from values held as
        :meth:`grouped` holds them: a group's leaves by one ``jax.lax.map`` over its
        buffer's rows (each row computed as its leaf alone: the same bits), not by a
        slice and a kernel of its own per leaf. A grouped leaf's comes with a leading
        axis of one: a slice of its group's rows, not a reshape of one."""
        firsts = {g[0] for g in self.groups}
        out = [None if x is None or i in firsts else fn(x) for i, x in enumerate(leaves)]
        for g in self.groups:
            rows = jax.lax.map(fn, jnp.ravel(leaves[g[0]]).reshape(len(g), -1))
            for k, i in enumerate(g):
                out[i] = rows[k : k + 1]
        return out

    def ungrouped(self, leaves: list) -> list:
        """The inverse of :meth:`grouped`: each leaf's value again, 1-D. XLA's CPU
        backend compiles each slice of a group's buffer as a kernel of its own, its
        offset built in (a stage-3 step of 512 leaves: 550 kernels). From jax 0.12 the
        offsets are given at run time, behind an ``optimization_barrier``, so a
        group's slices are one kernel (that step: 40 kernels on jax 0.12.1); jax 0.10
        removes the barrier and folds the offsets back in, so there the slices stay
        static. The same values either way."""
        out = list(leaves)
        for g in self.groups:
            flat, width = jnp.ravel(leaves[g[0]]), leaves[g[0]].size // len(g)
            if RUNTIME_OFFSETS:
                starts = tuple(jnp.int32(k * width) for k in range(len(g)))
                starts = jax.lax.optimization_barrier(starts)
                pieces = [jax.lax.dynamic_slice_in_dim(flat, s, width) for s in starts]
            else:
                pieces = jnp.split(flat, len(g))
            for i, piece in zip(g, pieces, strict=True):
                out[i] = piece
        return out

    def filled(self, tree: PyTree) -> PyTree:
        """``tree`` with a zero-element value at each hidden leaf (its group's buffer,
        none of its last axis), what the inner optimizer sees there (``tree`` as it
        is, with :attr:`holes`)."""
        if self.holes:
            return tree
        leaves = self.treedef.flatten_up_to(tree)
        for g in self.groups:
            for i in g[1:]:
                leaves[i] = leaves[g[0]][..., :0]
        return self.treedef.unflatten(leaves)

    def compact(self, tree: PyTree) -> PyTree:
        """``tree`` with ``None`` at each hidden leaf (the inverse of :meth:`filled`)."""
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(None if i in self.hidden else x for i, x in enumerate(leaves))


@dataclasses.dataclass(frozen=True)
class Joined:
    """A group's buffer, as the sums over its leaves see it: its leaves' pieces end to
    end (see :class:`zeroshard.core.layout.Slot`, whose attributes it has for the sums)."""

    slots: tuple[Any, ...]
    owned = layered = False

    @property
    def num_shards(self) -> int:
        return self.slots[0].num_shards

    @property
    def size(self) -> int:
        return sum(s.size for s in self.slots)

    @property
    def piece_size(self) -> int:
        return sum(s.piece_size for s in self.slots)

    def padding_mask(self, index: jax.Array | int) -> jax.Array:
        """Which elements of device ``index``'s buffer are its leaves' (not padding)."""
        return jnp.concatenate([s.padding_mask(index) for s in self.slots])


def _empty(shape: tuple[int, ...], dtype: Any, axis_name: str) -> jax.Array:
    """Zeros of ``shape``, typed varying over the axis as the pieces they stand with."""
    return vary(jnp.zeros(shape, dtype), axis_name)


def leaf_cost(slot: Any, matrix: bool) -> float:
    """Cost of a whole-tensor update: elements, times ``min(m, n)`` for matrix work."""
    return float(slot.size * (min(slot.shape[-2:]) if matrix and len(slot.shape) >= 2 else 1))


def make_plan(inner: Any, config: Any, base: Layout) -> Plan:
    """The :class:`Plan` for ``inner`` with the options ``config`` (a
    :class:`zeroshard.ShardConfig`) on ``base``, an all-sliced layout of the parameters.

    Raises:
      NotElementwiseError: if no placement makes the inner update exact, or a leaf
        forced sliced needs its whole tensor.
      ValueError: if the inner state's structure depends on the leaves' shapes.
    """
    master_dtypes = tuple(config.master_dtype_of(b.dtype) for b in base.buckets)
    inner_dtypes = [m or b.dtype for m, b in zip(master_dtypes, base.buckets, strict=True)]
    full, pieces = base.full_structs(inner_dtypes), base.full_structs(inner_dtypes, True)
    # (shapes and dtypes only: the sharding init gives them under jax.set_mesh of an
    # Explicit mesh would make the blocked update's full-shape trace close over its axes)
    shape_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    full_state = jax.tree.map(shape_of, jax.eval_shape(inner.init, full))
    piece_state = jax.eval_shape(inner.init, pieces)
    state_treedef = jax.tree.structure(full_state)
    _check_structure(state_treedef, piece_state)
    stacked = tuple(s.stacked for s in base.slots)
    analysis = analyze(
        inner, full, full_state, pieces, piece_state, config.axis_name, base.num_shards, stacked
    )
    blocks = _blocked(inner, config, base, analysis, full, full_state)
    layout = _place(config.placement, base, analysis, {i: b[0] for i, b in blocks.items()})
    profiles = [layout.profile(d) for d in range(layout.num_shards)]
    branches = tuple(dict.fromkeys(profiles))
    branch_of = tuple(branches.index(o) for o in profiles)
    order = config.sum_order.over(layout.slots)  # (its sums run over these leaves)
    plan = Plan(layout, master_dtypes, branches, branch_of, state_treedef, analysis, order=order)
    gathered = frozenset().union(*(g for *_, g in blocks.values()))
    kept = {k: a for _, found, _ in blocks.values() for k, a in found.items()}
    store = {k: BlockedState(a, k in gathered) for k, a in kept.items()}
    return _with_state(plan, inner, full_state, config, store)


def _blocked(inner: Any, config: Any, base: Layout, analysis: Analysis, full, full_state) -> dict:
    """The leaves to block (:class:`zeroshard.core.blocks.Blocked`), each with what
    :func:`zeroshard.core.blocks.blockable` found: largest whole-tensor cost first, until
    owning the others would leave no device more than its share (:func:`_balanced`);
    of those, the 2-D unstacked leaves whose rows divide by the devices, in no sum
    with other leaves, not forced owned, and whose update runs exactly on blocks of
    rows (else of columns, where they divide too). Per leaf: ``(its placement, where
    its state is kept, which state it reads whole)``."""
    n, forced = base.num_shards, _forced(config.placement, base)
    costs = {i: leaf_cost(base.slots[i], i in analysis.matrix) for i in analysis.whole}
    spanning = {i for x in analysis.sums if len(x) > 1 for i in x}
    found: dict = {}
    # Not in a fixed order of sums: the sums across blocks follow the device count.
    for i in sorted(costs, key=lambda i: -costs[i]) if n > 1 and config.sum_order.any_order else ():
        s = base.slots[i]
        if _balanced(base, analysis, costs, found):
            break
        if i in forced or i in spanning or s.stacked or len(s.shape) != 2 or s.shape[0] % n:
            continue
        for axis in (0, 1)[: 1 + (s.shape[1] % n == 0)]:
            got = blockable(inner, full, full_state, i, axis, analysis, config.axis_name, n)
            if got is not None:
                found[i] = (Blocked(axis), *got)
                break
    return found


def _balanced(base: Layout, analysis: Analysis, costs: dict, blocked: Any, bound=1.1) -> bool:
    """Whether, with the ``blocked`` leaves spread evenly and the other whole-tensor
    units (a layer-owned leaf's layers apart) owned largest cost first, no device
    would run more than ``bound`` times the mean whole-tensor cost or hold more than
    ``bound`` times the mean elements."""
    n, sizes = base.num_shards, [s.size for s in base.slots]
    units = []
    for i in (i for i in costs if i not in blocked):
        k = base.slots[i].shape[0] if i in analysis.layered else 1
        units += [(costs[i] / k, sizes[i] / k)] * k
    spread = sum(costs[i] for i in blocked) / n, (sum(sizes) - sum(u for _, u in units)) / n
    load = [spread] * n
    for cost, size in sorted(units, reverse=True):
        d = min(range(n), key=lambda d: load[d])
        load[d] = (load[d][0] + cost, load[d][1] + size)
    most = max(c for c, _ in load), max(s for _, s in load)
    return most[0] <= bound * sum(costs.values()) / n and most[1] <= bound * sum(sizes) / n


def _with_state(plan: Plan, inner: Any, full_state: PyTree, config: Any, blocked: dict) -> Plan:
    """``plan`` with each inner state leaf's kind (:mod:`zeroshard.core.state_kinds`; the
    ``blocked`` ones' given, by state leaf) and the owned values' storage."""
    layout, analysis = plan.layout, plan.analysis
    views = [jax.eval_shape(inner.init, plan.view_structs(b)) for b in range(len(plan.branches))]
    for v in views:
        _check_structure(plan.state_treedef, v)
    views = [jax.tree.leaves(v) for v in views]
    longer = jax.tree.leaves(jax.eval_shape(inner.init, plan.view_structs(0, longer=True)))
    kinds = []
    for k, (path, f) in enumerate(jax.tree_util.tree_flatten_with_path(full_state)[0]):
        leaf = analysis.state_leaves[k]
        if leaf is not None and layout.slots[leaf].blocked:  # kept as blocks, or whole
            kinds.append(blocked.get(k, ReplicatedState()))
            continue
        shapes = {(tuple(v[k].shape), v[k].dtype) for v in views}
        if leaf is not None and layout.slots[leaf].layered:
            kinds.append(OwnedState(layers_of=leaf))
        elif (leaf is not None and layout.slots[leaf].owned) or len(shapes) > 1:
            kinds.append(OwnedState(_source(layout, plan, views, k, leaf, f, path)))
        else:
            p, per_element = views[0][k], views[0][k].shape != longer[k].shape
            if not per_element and f.shape == p.shape:
                kinds.append(ReplicatedState())
            else:
                kinds.append(SlicedState(_sliced_slot(layout, leaf, f, p, path, per_element)))
    stored = [k for k, x in enumerate(kinds) if x.stored]
    storage = []
    for b, owned in enumerate(plan.branches):
        values = [(("state", k), views[b][k]) for k in stored]
        values += [
            (("master", i), jax.ShapeDtypeStruct(s.local_shape(n), plan.master_dtypes[s.bucket]))
            for i, n in owned
            if plan.master_dtypes[(s := layout.slots[i]).bucket] is not None
        ]
        storage.append(values)
    groups = ()
    # Groups sum a buffer of several leaves at once, in an order of their own: not
    # in a fixed order of sums.
    if config.group_alike and layout.num_shards > 1 and config.sum_order.any_order:
        groups = _groups(layout, analysis, kinds, config.pack_bytes)
    # Each leaf's record: its kind, full shape, dtype (in the view) and coding.
    coded = lambda x, v: (
        isinstance(x, SlicedState) and layout.slots[x.leaf].align and is_floating(v)
    )
    kinds = [
        dataclasses.replace(
            x,
            struct=jax.ShapeDtypeStruct(f.shape, v.dtype),
            coding=config.state_store if coded(x, v) else None,
        )
        for x, f, v in zip(kinds, jax.tree.leaves(full_state), views[0], strict=True)
    ]
    plan = dataclasses.replace(
        plan,
        storage=Storage.build(storage),
        groups=groups,
        state_kinds=tuple(kinds),
    )
    return dataclasses.replace(plan, holes=_takes_holes(plan, inner, full_state, config.axis_name))


def _takes_holes(plan: Plan, inner: Any, full_state: PyTree, axis_name: str) -> bool:
    """Whether the inner update, given the view with ``None`` at the hidden leaves,
    keeps the state's structure (``None`` at their state) and computes each group's
    first leaf as it does with every leaf present: its form (see
    :func:`zeroshard.analysis.groups.leaf_forms`) traced so equals the analysis's.
    Not tried where sums span leaves (a global norm then sums other terms). Tracing
    the update once per group instead of once per leaf is what this saves."""
    analysis = plan.analysis
    if not plan.groups or any(len(x) > 1 for x in analysis.sums):
        return False
    view, n = plan.view_structs(0, holes=True), plan.layout.num_shards
    try:  # a tree with holes it cannot take: the hidden leaves stay zero-element arrays
        state = jax.eval_shape(inner.init, view)
        if jax.tree.structure(state) != jax.tree.structure(plan.on_state.compact(full_state)):
            return False
        closed, extra = trace_update(inner, view, state, axis_name, n, analysis.stand_ins())
    except Exception:  # any failure of the inner optimizer on it means no
        return False
    present = [i for i in range(len(plan.layout.slots)) if i not in plan.hidden]
    kept = [j for k, j in enumerate(analysis.state_leaves) if k not in plan.on_state.hidden]
    forms = leaf_forms(closed, present, kept, input_names((view, state, view, extra)))
    return all(forms[g[0]] == analysis.forms[g[0]] for g in plan.groups)


def _groups(
    layout: Layout, analysis: Analysis, kinds: list, pack_bytes: int
) -> tuple[tuple[int, ...], ...]:
    """The groups of sliced leaves updated as one buffer (see :class:`Plan`): alike
    leaves (equal forms, see :func:`zeroshard.analysis.groups.leaf_forms`: the same
    computation on pieces of one shape) of one dtype that are cut whole (not layer by
    layer), whose update is elementwise but for sums over several leaves (a global norm;
    no sum over one leaf) and whose state is per element. On such leaves, laying the
    pieces end to end changes no elementwise result: every element is computed as before
    from the same values (a global norm's sum in another order). Only leaves smaller
    than ``pack_bytes`` are grouped: they travel in packed collectives, whose rows lay a
    group's pieces out together, so grouping them is a slice of the row; a larger leaf's
    collective moves it directly, and a group would copy it. On one device the pieces
    are the leaves themselves, and are left as they are (plain optax's layout, no
    copies)."""
    # A sum over one leaf (a norm, an RMS) is per leaf: it keeps the leaf apart. A sum
    # over several (a global norm) is over the group's buffer too, padding left out.
    summed = set().union(*(x for x in analysis.sums if len(x) == 1), analysis.layer_sums)
    own = collections.defaultdict(list)  # per leaf, its state leaves
    for k, i in enumerate(analysis.state_leaves):
        own[i].append(k)

    slot_of = lambda x: x.leaf if isinstance(x, SlicedState) else None

    def fit(i: int) -> bool:
        s = layout.slots[i]
        if s.size * s.dtype.itemsize >= pack_bytes:
            return False
        per_element = all(slot_of(kinds[k]) == i for k in own[i])
        shaped = sum(slot_of(x) == i for x in kinds) == len(own[i])
        alone = s.owned or s.stacked or s.blocked or s.split.blocks > 1 or s.align or i in summed
        return not alone and per_element and shaped

    groups = []
    classes: dict[Any, list[int]] = {}  # alike leaves, by form and dtype
    for i, form in enumerate(analysis.forms):
        if form is not None:
            classes.setdefault((form, layout.slots[i].bucket), []).append(i)
    for alike in classes.values():
        g = tuple(i for i in alike if fit(i))
        if len(g) > 1:
            groups.append(g)
    return tuple(groups)


def _check_structure(treedef: Any, state: PyTree) -> None:
    if jax.tree.structure(state) != treedef:
        raise ValueError(
            "zs.sharded: the inner optimizer's state has a different structure on a slice "
            "than on the full parameters, so it depends on leaf shapes and cannot be sharded."
        )


def _place(placement: Any, base: Layout, analysis: Analysis, blocked: dict[int, int]) -> Layout:
    """``base`` with the leaves that need whole tensors (or are forced to) owned, but
    the ``blocked`` ones."""
    forced = _forced(placement, base)
    for i, s in enumerate(base.slots):
        if forced.get(i) == "sliced" and i in analysis.whole:
            raise NotElementwiseError(
                f"zs.sharded: placement forces {s.path} sliced, but the inner optimizer's "
                "update of it needs the whole tensor (it mixes its elements): slicing it "
                "would silently compute different numbers. Let it be owned."
            )
    owned = (set(analysis.whole) | {i for i, p in forced.items() if p == "owned"}) - set(blocked)
    costs = {i: leaf_cost(base.slots[i], i in analysis.matrix) for i in owned}
    # A leaf whose layers meet through sums needs a layer on every device (each device
    # then runs the same sums): its layers are placed first; where some device still
    # holds none (fewer layers than devices), it is owned whole.
    layered, sums = analysis.layered & owned, analysis.layer_sums & owned
    place = lambda layered: base.placed(costs, layered, sums & layered, blocked)
    layout = place(layered)
    held = lambda i: len(set(layout.slots[i].owners)) == base.num_shards
    if all(held(i) for i in sums & layered):
        return layout
    return place({i for i in layered if i not in sums or held(i)})


def _forced(placement: Any, base: Layout) -> dict[int, str]:
    """The user's placements by leaf index (``"sliced"``/``"owned"``; unset: automatic)."""
    if placement is None:
        return {}
    if callable(placement):
        structs = base.treedef.flatten_up_to(base.full_structs())
        chosen = [placement(s.path, x) for s, x in zip(base.slots, structs, strict=True)]
    else:
        chosen = base.treedef.flatten_up_to(placement)
    for s, c in zip(base.slots, chosen, strict=True):
        if c not in (None, "auto", "sliced", "owned"):
            raise ValueError(
                f"placement of {s.path} is {c!r}; use 'sliced', 'owned' or None (automatic)."
            )
    return {i: c for i, c in enumerate(chosen) if c in ("sliced", "owned")}


def _source(layout, plan, views, k, leaf, full, path) -> int:
    """The device holding owned state leaf ``k`` as plain optax would."""
    if leaf is not None and layout.slots[leaf].owned:
        return layout.slots[leaf].owner
    for d, b in enumerate(plan.branch_of):
        if tuple(views[b][k].shape) == tuple(full.shape):
            return d
    raise ValueError(
        f"zs.sharded: inner state leaf {jax.tree_util.keystr(path)} has shape "
        f"{tuple(full.shape)} for the full parameters but a different shape on every "
        "device's view: it cannot be mapped back to plain optax's state."
    )


def _sliced_slot(layout, leaf, full, piece, path, per_element: bool) -> int:
    """The sliced parameter whose pieces a per-element state leaf is shaped like (none
    for a leaf that is not per-element: refused)."""
    for i in ([leaf] * (leaf is not None) + list(range(len(layout.slots)))) * per_element:
        s = layout.slots[i]
        if not s.owned and (s.shape, s.piece_shape) == (tuple(full.shape), tuple(piece.shape)):
            return i
    raise ValueError(
        f"zs.sharded: inner state leaf {jax.tree_util.keystr(path)} has shape "
        f"{tuple(full.shape)} for the full parameters but {tuple(piece.shape)} for a slice: "
        "it is neither per-element nor independent of the parameters."
    )
