"""Partition: how a parameter tree maps onto N equal slices, one per device.

Each floating-point leaf has a *placement*, held by its :class:`Slot` together with
the geometry that cuts a leaf into pieces and puts the pieces back together:

- **sliced** (the default): the leaf is raveled, padded to a multiple of
  ``num_shards`` and cut into ``num_shards`` equal contiguous pieces; device ``d``
  owns piece ``d``.
- **stacked**: a leaf of stacked layers (a leading layer axis, as ``jax.lax.scan``,
  ``nnx.scan`` or ``nn.scan`` over layers use) is cut layer by layer: each layer is
  raveled, padded and cut into ``num_shards`` pieces, and device ``d`` owns piece
  ``d`` of *every* layer. Scanning over a stage-3 parameter then hands each
  iteration this device's piece of one layer (see :mod:`zeroshard.gather`).

Leaves of one dtype form a *bucket*: the pieces a device owns, laid end to end, are
that device's *row* of the bucket (how the master weights are stored). The
collectives of a step move a large leaf's pieces directly, with no copy into or out
of a packed buffer; small leaves of one dtype are packed together (:meth:`groups`).

Owning a piece of every leaf keeps the tree structure visible to the inner
optimizer: it sees a pytree shaped like the parameters whose leaves are this
device's pieces. Each piece keeps its leaf's rank (shape ``(1, ..., 1, width)``, or
``(layers, 1, ..., width)`` for a stacked leaf), so the common ``p.ndim > 1``
weight-decay masks select the same leaves as on full parameters. The padding is less
than ``num_shards`` elements per leaf (per layer, for stacked leaves).

Example:
    >>> import jax.numpy as jnp
    >>> layout = Layout.from_tree({"w": jnp.zeros((3, 5)), "b": jnp.zeros(5)}, 4)
    >>> [(s.path, s.piece_size) for s in layout.slots]
    [("['b']", 2), ("['w']", 4)]
    >>> layout.slots[1].piece_shape
    (1, 4)
    >>> stacked = Layout.from_tree({"w": jnp.zeros((3, 5))}, 4, stacked=["w"])
    >>> stacked.slots[0].placement, stacked.slots[0].piece_shape
    ('stacked', (3, 2))
    >>> [(b.dtype.name, b.row_size) for b in layout.buckets]
    [('float32', 6)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

Stacked = Collection[str] | Callable[[str, Any], int] | None
"""Which leaves hold stacked layers: ``None`` (none), a collection of names (every
leaf below a dict key or attribute of that name has one leading layer axis), or a
function ``(path, leaf) -> int`` giving the number of leading layer axes."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter leaf: its placement and where its pieces live.

    Attributes:
      path: the leaf's key path, as ``jax.tree_util.keystr`` prints it.
      shape: the leaf's full shape.
      dtype: the leaf's dtype.
      bucket: index of the dtype bucket holding the leaf.
      offset: first column of the leaf's piece in the bucket row.
      num_shards: the number of devices the leaf is cut over.
      stacked: the number of leading layer axes (0: a sliced leaf).
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    bucket: int
    offset: int
    num_shards: int
    stacked: int = 0

    @property
    def placement(self) -> str:
        """``"sliced"`` or ``"stacked"``."""
        return "stacked" if self.stacked else "sliced"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def layers(self) -> int:
        """Layers cut separately: 1 for a sliced leaf."""
        return math.prod(self.shape[: self.stacked])

    @property
    def width(self) -> int:
        """Elements per device of one layer: ``ceil(layer size / num_shards)``."""
        return -(-math.prod(self.shape[self.stacked :]) // self.num_shards)

    @property
    def piece_size(self) -> int:
        """Elements per device."""
        return self.layers * self.width

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """Shape of one device's piece: the leaf's rank, the layer axes, ones, the width."""
        k = self.stacked
        return (*self.shape[:k], *(1,) * (len(self.shape) - k - 1), self.width)

    def _padded(self, leaf: jax.Array) -> jax.Array:
        """``(layers, num_shards * width)``: each layer raveled and zero-padded."""
        rows = jnp.reshape(leaf, (self.layers, -1))
        return jnp.pad(rows, ((0, 0), (0, self.num_shards * self.width - rows.shape[1])))

    def cut(self, leaf: jax.Array, index: jax.Array | int) -> jax.Array:
        """Device ``index``'s 1-D piece of the full ``leaf``."""
        cols = jax.lax.dynamic_slice_in_dim(self._padded(leaf), index * self.width, self.width, 1)
        return cols.reshape(-1)

    def blocks(self, leaf: jax.Array) -> jax.Array:
        """Every device's piece of ``leaf``: ``(num_shards, piece_size)``, row ``d`` for
        device ``d`` (what a reduce-scatter scatters)."""
        n, padded = self.num_shards, self._padded(leaf)
        if self.layers == 1:
            return padded.reshape(n, self.width)
        return padded.reshape(self.layers, n, self.width).swapaxes(0, 1).reshape(n, -1)

    def uncut(self, pieces: jax.Array) -> jax.Array:
        """The full leaf from every device's piece (``(num_shards, ...)``, row ``d`` from
        device ``d``, as an all-gather returns them): the inverse of :meth:`blocks`."""
        n, layer = self.num_shards, math.prod(self.shape[self.stacked :])
        rows = pieces.reshape(n, self.layers, self.width)
        rows = rows.reshape(n * self.width) if self.layers == 1 else rows.swapaxes(0, 1)
        return rows.reshape(self.layers, -1)[:, :layer].reshape(self.shape)


def stacked_dims(tree: PyTree, stacked: Stacked) -> tuple[int, ...]:
    """The number of leading layer axes of each leaf of ``tree`` (see :data:`Stacked`).

    Raises:
      ValueError: if a leaf marked stacked has no axis besides its layer axes.
    """
    path_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if stacked is None:
        return (0,) * len(path_leaves)
    if isinstance(stacked, str):
        stacked = (stacked,)
    names = None if callable(stacked) else frozenset(stacked)
    dims = []
    for path, leaf in path_leaves:
        name = jax.tree_util.keystr(path)
        if names is None:
            k = int(stacked(name, leaf))
        else:
            keys = {str(getattr(p, "key", getattr(p, "name", None))) for p in path}
            k = int(bool(keys & names))
        if k and len(leaf.shape) <= k:
            raise ValueError(
                f"leaf {name} of shape {tuple(leaf.shape)} is marked stacked with {k} layer "
                "axes but has no axis besides them; keep per-layer scalars as shape (layers, 1)"
                " or leave the leaf out of `stacked`."
            )
        dims.append(k)
    return tuple(dims)


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
    def from_tree(cls, tree: PyTree, num_shards: int, stacked: Stacked = None) -> Layout:
        """Lays out ``tree`` over ``num_shards`` devices.

        Args:
          tree: the parameters (arrays or ``jax.ShapeDtypeStruct``).
          num_shards: the number of devices.
          stacked: which leaves hold stacked layers (see :data:`Stacked`).

        Raises:
          ValueError: if the tree has no leaves, or a stacked leaf has no axis
            besides its layer axes.
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
        dims = stacked_dims(tree, stacked)
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
            slot = Slot(name, tuple(leaf.shape), dtype, b, offsets[b], num_shards, dims[i])
            slots.append(slot)
            offsets[b] += slot.piece_size
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
        """Shape of one device's piece of ``slot`` (:attr:`Slot.piece_shape`)."""
        return slot.piece_shape

    def full_structs(self, dtypes: Sequence[Any] | None = None) -> PyTree:
        """A tree of ``ShapeDtypeStruct`` full leaves (bucket ``b`` in ``dtypes[b]``)."""
        return self.treedef.unflatten(
            jax.ShapeDtypeStruct(s.shape, s.dtype if dtypes is None else dtypes[s.bucket])
            for s in self.slots
        )

    def piece_structs(self, dtypes: Sequence[Any] | None = None) -> PyTree:
        """A tree of ``ShapeDtypeStruct`` pieces (bucket ``b`` in ``dtypes[b]``)."""
        return self.treedef.unflatten(
            jax.ShapeDtypeStruct(s.piece_shape, s.dtype if dtypes is None else dtypes[s.bucket])
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
        leaves = self.treedef.flatten_up_to(tree)
        return [s.cut(leaf, index) for leaf, s in zip(leaves, self.slots, strict=True)]

    def row(self, tree: PyTree, index: jax.Array | int, bucket: int) -> jax.Array:
        """Device ``index``'s row of bucket ``bucket``, cut from full leaves."""
        pieces = self.pieces(tree, index)
        return jnp.concatenate([pieces[i] for i in self.buckets[bucket].slots])

    # Rows <-> trees of pieces (what the inner optimizer sees).

    def split(self, rows: Sequence[jax.Array]) -> PyTree:
        """One row per bucket -> a tree of this device's pieces."""
        return self.treedef.unflatten(
            rows[s.bucket][s.offset : s.offset + s.piece_size].reshape(s.piece_shape)
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
            p.reshape(s.piece_shape) for p, s in zip(pieces, self.slots, strict=True)
        )
