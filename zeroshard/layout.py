"""Partition: how a parameter tree maps onto N equal slices, one per device.

Every floating-point leaf is raveled, padded to a multiple of ``num_shards`` and cut
into ``num_shards`` equal contiguous pieces; device ``d`` owns piece ``d`` of every
leaf. Leaves of one dtype form a *bucket*: the pieces a device owns, laid end to end,
are that device's *row* of the bucket (how the master weights are stored). The
collectives of a step move a large leaf's pieces directly, with no copy into or out
of a packed buffer; small leaves of one dtype are packed together (:meth:`groups`).

Owning a piece of every leaf (rather than a contiguous run of a single raveled
buffer) keeps the tree structure visible to the inner optimizer: it sees a pytree
shaped like the parameters whose leaves are this device's pieces. Each piece keeps
its leaf's rank (shape ``(1, ..., 1, piece_size)``), so the common ``p.ndim > 1``
weight-decay masks select the same leaves as on full parameters. Memory per device
is ``ceil(size / num_shards)`` elements per leaf: the padding is less than
``num_shards`` elements per leaf.

Example:
    >>> import jax.numpy as jnp
    >>> layout = Layout.from_tree({"w": jnp.zeros((3, 5)), "b": jnp.zeros(5)}, 4)
    >>> [(s.path, s.piece_size) for s in layout.slots]
    [("['b']", 2), ("['w']", 4)]
    >>> layout.piece_shape(layout.slots[1])
    (1, 4)
    >>> [(b.dtype.name, b.row_size) for b in layout.buckets]
    [('float32', 6)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one parameter leaf lives in its bucket.

    Attributes:
      path: the leaf's key path, as ``jax.tree_util.keystr`` prints it.
      shape: the leaf's full shape.
      dtype: the leaf's dtype.
      bucket: index of the dtype bucket holding the leaf.
      offset: first column of the leaf's piece in the bucket row.
      piece_size: elements per device, ``ceil(size / num_shards)``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    bucket: int
    offset: int
    piece_size: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """All leaves of one dtype: an ``(num_shards, row_size)`` matrix."""

    dtype: np.dtype
    slots: tuple[int, ...]
    row_size: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static map between a parameter tree and per-device rows of dtype buckets.

    Built from shapes and dtypes only (``jax.ShapeDtypeStruct`` leaves work), so it is
    hashable and free to compute at trace time.
    """

    treedef: jax.tree_util.PyTreeDef
    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]
    num_shards: int

    @classmethod
    def from_tree(cls, tree: PyTree, num_shards: int) -> Layout:
        """Lays out ``tree`` over ``num_shards`` devices.

        Raises:
          ValueError: if the tree has no leaves.
          TypeError: if a leaf is not floating point.
        """
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if not path_leaves:
            raise ValueError(
                "zeroshard got an empty parameter tree: there is nothing to shard. "
                "Pass the model's parameters (a pytree with at least one array)."
            )
        dtypes: list[np.dtype] = []
        offsets: list[int] = []
        members: list[list[int]] = []
        slots = []
        for i, (path, leaf) in enumerate(path_leaves):
            dtype = np.dtype(leaf.dtype)
            name = jax.tree_util.keystr(path)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(
                    f"zeroshard shards floating-point parameters only, but leaf {name} has "
                    f"dtype {dtype}. Keep integer or boolean state out of the tree passed "
                    "to the optimizer (e.g. in a separate collection)."
                )
            if dtype not in dtypes:
                dtypes.append(dtype)
                offsets.append(0)
                members.append([])
            b = dtypes.index(dtype)
            piece = -(-math.prod(leaf.shape) // num_shards)
            slots.append(Slot(name, tuple(leaf.shape), dtype, b, offsets[b], piece))
            offsets[b] += piece
            members[b].append(i)
        buckets = tuple(
            Bucket(d, tuple(m), o) for d, m, o in zip(dtypes, members, offsets, strict=True)
        )
        return cls(treedef, tuple(slots), buckets, num_shards)

    def groups(self, pack_bytes: int) -> tuple[tuple[int, ...], ...]:
        """The leaves that share one collective: each leaf of at least ``pack_bytes``
        alone, and the smaller leaves of each dtype packed together, in leaf order, into
        groups of at most ``pack_bytes`` (so no packed copy is larger)."""
        groups = []
        for b in self.buckets:
            nbytes = {i: self.slots[i].size * b.dtype.itemsize for i in b.slots}
            run: list[int] = []
            for i in (i for i in b.slots if nbytes[i] < pack_bytes):
                if run and sum(nbytes[j] for j in run) + nbytes[i] > pack_bytes:
                    groups.append(tuple(run))
                    run = []
                run.append(i)
            groups += [tuple(run)] if run else []
            groups += [(i,) for i in b.slots if nbytes[i] >= pack_bytes]
        return tuple(groups)

    def columns(self, group: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """``(leaf, start, stop)`` of each leaf's piece in a group's packed row."""
        out, start = [], 0
        for i in group:
            out.append((i, start, start + self.slots[i].piece_size))
            start += self.slots[i].piece_size
        return out

    def piece_shape(self, slot: Slot) -> tuple[int, ...]:
        """Shape of one device's piece of ``slot``: the leaf's rank, ones then the piece."""
        return (1,) * (len(slot.shape) - 1) + (slot.piece_size,)

    def full_structs(self, dtypes: Sequence[Any] | None = None) -> PyTree:
        """A tree of ``ShapeDtypeStruct`` full leaves (bucket ``b`` in ``dtypes[b]``)."""
        return self.treedef.unflatten(
            jax.ShapeDtypeStruct(s.shape, s.dtype if dtypes is None else dtypes[s.bucket])
            for s in self.slots
        )

    def piece_structs(self, dtypes: Sequence[Any] | None = None) -> PyTree:
        """A tree of ``ShapeDtypeStruct`` pieces (bucket ``b`` in ``dtypes[b]``)."""
        return self.treedef.unflatten(
            jax.ShapeDtypeStruct(
                self.piece_shape(s), s.dtype if dtypes is None else dtypes[s.bucket]
            )
            for s in self.slots
        )

    def check_matches(self, tree: PyTree, what: str) -> None:
        """Raises a ``ValueError`` naming the first leaf where ``tree`` differs."""
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"{what} do not have the parameters' tree structure:\n  {treedef}\n"
                f"vs params:\n  {self.treedef}"
            )
        for (path, leaf), slot in zip(path_leaves, self.slots, strict=True):
            if tuple(leaf.shape) != slot.shape:
                raise ValueError(
                    f"{what} leaf {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, "
                    f"but the parameter has shape {slot.shape}."
                )

    # Full leaves -> this device's pieces and rows.

    def pieces(self, tree: PyTree, index: jax.Array | int) -> list[jax.Array]:
        """Device ``index``'s 1-D piece of every leaf of ``tree`` (full leaves)."""
        pieces = []
        for leaf, s in zip(self.treedef.flatten_up_to(tree), self.slots, strict=True):
            flat = jnp.pad(jnp.ravel(leaf), (0, self.num_shards * s.piece_size - s.size))
            pieces.append(jax.lax.dynamic_slice_in_dim(flat, index * s.piece_size, s.piece_size))
        return pieces

    def row(self, tree: PyTree, index: jax.Array | int, bucket: int) -> jax.Array:
        """Device ``index``'s row of bucket ``bucket``, cut from full leaves."""
        pieces = self.pieces(tree, index)
        return jnp.concatenate([pieces[i] for i in self.buckets[bucket].slots])

    # Rows <-> trees of pieces (what the inner optimizer sees).

    def split(self, rows: Sequence[jax.Array]) -> PyTree:
        """One row per bucket -> a tree of this device's pieces."""
        return self.treedef.unflatten(
            rows[s.bucket][s.offset : s.offset + s.piece_size].reshape(self.piece_shape(s))
            for s in self.slots
        )

    def join(self, pieces: PyTree) -> tuple[jax.Array, ...]:
        """A tree of pieces -> one row per bucket (the inverse of :meth:`split`)."""
        return self.rows(self.treedef.flatten_up_to(pieces))

    def rows(self, pieces: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Pieces, one per leaf in leaf order -> one row per bucket."""
        return tuple(jnp.concatenate([jnp.ravel(pieces[i]) for i in b.slots]) for b in self.buckets)

    def shaped(self, pieces: Sequence[jax.Array]) -> PyTree:
        """1-D pieces, one per leaf -> the tree of pieces the inner optimizer sees."""
        return self.treedef.unflatten(
            p.reshape(self.piece_shape(s)) for p, s in zip(pieces, self.slots, strict=True)
        )
