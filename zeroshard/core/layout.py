"""Layout: how a parameter tree maps onto N devices, leaf by leaf.

Each floating-point leaf has a *placement*, held by its :class:`Slot` together with
the geometry that cuts a leaf into pieces and puts the pieces back together:

- **sliced** (the default): the leaf is raveled, padded to a multiple of
  ``num_shards`` and cut into ``num_shards`` equal contiguous pieces; device ``d``
  owns piece ``d``.
- **stacked**: a leaf of stacked layers (a leading layer axis, as ``jax.lax.scan``,
  ``nnx.scan`` or ``nn.scan`` over layers use) is cut layer by layer: each layer is
  raveled, padded and cut into ``num_shards`` pieces, and device ``d`` owns piece
  ``d`` of *every* layer. Scanning over a stage-3 parameter then hands each
  iteration this device's piece of one layer (see :mod:`zeroshard.communication.stage3`).
- **owned**: the whole leaf lives on one device, its owner, for optimizers whose
  update needs the whole tensor (chosen by :mod:`zeroshard.core.placement`); or, for a
  stacked leaf whose update treats each layer separately (Muon with the layer as a
  batch axis), **layer-owned**: each layer lives whole on one device. The *units*
  (whole leaves, layers) are balanced over the devices, largest cost first. The units
  a device owns, end to end, are its *owned row* of the bucket, padded to the most
  loaded device's (``Bucket.owned_width``); in stage 3, one device's pieces of them
  are its *chunk* (``Bucket.owned_chunk``). Each slot knows where its units lie in
  both (:meth:`Slot.unit_spans`), and :meth:`Layout.sliced` / :meth:`Layout.owned`
  map a function over the one kind of leaf, so the sliced/owned difference of a
  per-leaf list is said in one place.

Leaves of one dtype form a *bucket*: the pieces a device holds of its sliced leaves,
laid end to end, are that device's *row* of the bucket (what a packed collective
moves; the state keeps one piece per leaf, or per group of leaves with the same
update: :attr:`zeroshard.core.placement.Plan.groups`). The collectives of a step move a
large leaf's pieces directly, with no copy into or out of a packed buffer; small
leaves of one dtype are packed together (:meth:`Layout.groups`).

Holding a piece of every sliced leaf keeps the tree structure visible to the inner
optimizer: it sees a pytree shaped like the parameters whose leaves are this
device's pieces (and whole leaves where it owns them). Each piece keeps its leaf's
rank (shape ``(1, ..., 1, width)``, or ``(layers, 1, ..., width)`` for a stacked
leaf), so the common ``p.ndim > 1`` weight-decay masks select the same leaves as on
full parameters. The padding is less
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
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroshard.core.rows import pack

PyTree = Any

Stacked = Collection[str] | Callable[[str, Any], int] | None
"""Which leaves hold stacked layers: ``None`` (none), a collection of names (every
leaf below a dict key or attribute of that name has one leading layer axis), or a
function ``(path, leaf) -> int`` giving the number of leading layer axes."""


@dataclasses.dataclass(frozen=True)
class Split:
    """How a leaf is cut into *blocks* over the mesh's axes besides the batch's
    (tensor parallelism's ``"model"``, say), its state kept by Megatron's rule: each
    block (the device's block of the leaf, as its layout holds it) is cut over the
    batch axes alone, so the gradient is reduce-scattered, and the new weights
    all-gathered, within the block. Device ``index`` over the state's axes (the
    batch's first) holds piece ``index // blocks`` of block ``index % blocks``. A
    leaf held whole is one block (:data:`WHOLE`): its block is the leaf, cut over
    every axis of the state.

    Attributes:
      dim: the leaf's dimension that is split (not a layer axis).
      axes: the mesh axes it is split over (every axis of the state besides the
        batch's, in the mesh's order; none for one block).
      blocks: the number of blocks (the devices along ``axes``).
      over: the batch axes each block's pieces are cut over (none: every axis of
        the state).
    """

    dim: int
    axes: tuple[str, ...]
    blocks: int
    over: tuple[str, ...]

    def leaf_spec(self, ndim: int) -> P:
        """``PartitionSpec`` of the leaf as its layout holds it (its block per device)."""
        return _spec([self.axes if k == self.dim else () for k in range(ndim)])

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one block of a leaf of ``shape``."""
        return tuple(d // self.blocks if k == self.dim else d for k, d in enumerate(shape))

    def block(self, leaf: jax.Array, m: jax.Array | int) -> jax.Array:
        """Block ``m`` of ``leaf`` (the leaf, for one block)."""
        if self.blocks == 1:
            return leaf
        size = leaf.shape[self.dim] // self.blocks
        return jax.lax.dynamic_slice_in_dim(
            leaf, m * size, size, self.dim, allow_negative_indices=False
        )


WHOLE = Split(0, (), 1, ())
"""The split of a leaf held whole: one block."""


def _spec(entries: Sequence[str | tuple[str, ...]]) -> P:
    """A ``PartitionSpec`` of ``entries`` (mesh axes per dimension; a name alone where
    one); ``P()`` where they name none."""
    named = [
        None if not e else e[0] if len(e) == 1 and not isinstance(e, str) else e for e in entries
    ]
    return P(*named) if any(named) else P()


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter leaf: its placement and where its pieces live.

    Attributes:
      path: the leaf's key path, as ``jax.tree_util.keystr`` prints it.
      shape: the leaf's full shape.
      dtype: the leaf's dtype.
      bucket: index of the dtype bucket holding the leaf.
      num_shards: the number of devices the leaf is cut over.
      stacked: the number of leading layer axes: its pieces are cut layer by layer
        (for an owned leaf, the stage-3 pieces of its weights).
      owners: for an owned leaf, the device holding each of its *units*: the whole
        leaf (one unit), or each layer of a layer-owned leaf; ``()`` for a sliced leaf.
      layered: whether the leaf is layer-owned (one layer axis; a unit per layer).
      unit_offsets: each unit's place in its owner's owned row of the bucket.
      chunk_offsets: each unit's place in its owner's stage-3 chunk of the bucket
        (where one device's pieces of the units it owns lie, ``unit_piece`` each).
      chunks: ``0``, or the number of canonical chunks each layer is cut into, a
        multiple of ``num_shards``: each device's piece is then ``chunks /
        num_shards`` whole chunks (the fixed-order sums of ``deterministic=``; see
        :mod:`zeroshard.communication.canonical`).
      block: for a *blocked* leaf, its placement (a
        :class:`zeroshard.core.blocks.Blocked`: the axis its update runs on blocks along,
        and how a block goes to and from its piece), else ``None``.
      split: how the leaf is cut into blocks over the mesh's other axes
        (:class:`Split`; :data:`WHOLE`: one block). Its pieces are the pieces of its
        blocks (:attr:`moved`); where the update runs (manual over every axis of the
        state) its gradient and weights are the device's block (:meth:`own`).
      align: ``0``, or the elements a piece's width is a multiple of (of each layer:
        the block of the leaf's coded state, :mod:`zeroshard.core.lowbit`), so that the
        blocks of every device's piece follow the leaf's global index.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    bucket: int
    num_shards: int
    stacked: int = 0
    owners: tuple[int, ...] = ()
    layered: bool = False
    unit_offsets: tuple[int, ...] = ()
    chunk_offsets: tuple[int, ...] = ()
    chunks: int = 0
    block: Any = None
    split: Split = WHOLE
    align: int = 0

    @property
    def placement(self) -> str:
        """``"sliced"``, ``"stacked"``, ``"owned"``, ``"layer-owned"`` or ``"blocked"``."""
        if self.owners:
            return "layer-owned" if self.layered else "owned"
        return "blocked" if self.blocked else "stacked" if self.stacked else "sliced"

    @property
    def blocked(self) -> bool:
        return self.block is not None

    @property
    def owned(self) -> bool:
        return bool(self.owners)

    @property
    def owner(self) -> int | None:
        """The device holding a whole-owned leaf (``None`` otherwise)."""
        return self.owners[0] if self.owned and not self.layered else None

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """The shape of one owned unit: a layer of a layer-owned leaf, else the leaf."""
        return self.shape[1:] if self.layered else self.shape

    def units_of(self, device: int) -> tuple[int, ...]:
        """The units of this owned leaf that ``device`` holds."""
        return tuple(u for u, d in enumerate(self.owners) if d == device)

    def unit_spans(self, pieces: bool = False) -> list[tuple[int, int, int]]:
        """``(owner, start, stop)`` of each unit of this owned leaf in its owner's owned
        row, or with ``pieces`` in its owner's stage-3 chunk (one device's piece of it)."""
        size = self.unit_piece if pieces else math.prod(self.unit_shape)
        offsets = self.chunk_offsets if pieces else self.unit_offsets
        return [(d, o, o + size) for d, o in zip(self.owners, offsets, strict=True)]

    @property
    def unit_piece(self) -> int:
        """Elements of one device's stage-3 piece of one owned unit: of each layer of a
        layer-owned leaf, else of the whole leaf."""
        return self.width if self.layered else self.piece_size

    def unit_geometry(self) -> Slot:
        """How one owned unit is cut into stage-3 pieces (a layer of a layer-owned leaf
        as a leaf of its own)."""
        if not self.layered:
            return self
        return Slot.of(self.unit_shape, self.dtype, self.num_shards, chunks=self.chunks)

    def local_shape(self, count: int) -> tuple[int, ...]:
        """The shape of ``count`` units of this owned leaf, as their owner holds them."""
        return (count, *self.unit_shape) if self.layered else self.shape

    def local(self, full: jax.Array, device: Any, count: int | None = None) -> jax.Array:
        """``device``'s units of the full owned leaf: the leaf, or its layers stacked.
        With ``count``, ``device`` may be traced: the ``count`` units it holds, for
        devices that hold that many (others get some ``count`` layers)."""
        if not self.layered:
            return full
        if count is None:
            return full[np.asarray(self.units_of(device), np.int32)]
        table = [(self.units_of(d) + (0,) * count)[:count] for d in range(self.num_shards)]
        return jnp.take(full, jnp.asarray(table, jnp.int32)[device], axis=0)

    @property
    def stand_in_shape(self) -> tuple[int, ...]:
        """The shape of what a device that does not own the leaf sees in its place: one
        zero of the leaf's rank (so rank-based masks agree and shape arithmetic, such
        as a fan-out over fan-in ratio, stays finite). What is computed on it is
        discarded; zeros stay zero through elementwise updates, like padding does."""
        return (1,) * len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def layers(self) -> int:
        """Layers cut separately: 1 for a sliced leaf."""
        return math.prod(self.shape[: self.stacked])

    @property
    def width(self) -> int:
        """Elements per device of one layer: ``ceil(layer size / devices)``, or with
        ``chunks``, ``chunks / devices`` chunks of ``ceil(layer size / chunks)``, of
        its block, over the devices its block is cut over."""
        return self.chunk * (self.chunks // self.num_shards or 1)

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The leaf's shape where the update runs: its block's."""
        return self.split.block_shape(self.shape)

    @property
    def moved(self) -> Slot:
        """The geometry the step's collectives cut and join: the leaf's block, over the
        devices it is cut over (every device of the state, for a leaf of one block)."""
        m = self.split.blocks
        return Slot.of(
            self.held_shape,
            self.dtype,
            self.num_shards // m,
            self.stacked,
            self.chunks // m,
            self.align,
        )

    def own(self, held: jax.Array, index: jax.Array | int) -> jax.Array:
        """Device ``index``'s 1-D piece of the leaf as the update holds it: of the
        device's block."""
        moved, index = self.moved, self.piece_index(index)
        if moved.num_shards == 1 and moved.piece_size == moved.size:
            return jnp.ravel(held)
        one = moved.layers == 1  # (one layer: cut from it raveled, 1-D as it comes)
        rows = moved._padded(held, flat=one)
        cols = jax.lax.dynamic_slice_in_dim(
            rows, index * moved.width, moved.width, rows.ndim - 1, allow_negative_indices=False
        )
        return cols if one else cols.reshape(-1)

    @property
    def chunk(self) -> int:
        """Elements of one canonical chunk of a layer of its block (with ``chunks``,
        over the blocks, the blocks in order; else the width), a multiple of
        :attr:`align`."""
        n = self.chunks // self.split.blocks or self.num_shards // self.split.blocks
        chunk = -(-math.prod(self.held_shape[self.stacked :]) // n)
        return -(-chunk // self.align) * self.align if self.align else chunk

    @property
    def piece_size(self) -> int:
        """Elements per device."""
        return self.layers * self.width

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """Shape of one device's piece: the leaf's rank, the layer axes, ones, the width."""
        k = self.stacked
        return (*self.shape[:k], *(1,) * (len(self.shape) - k - 1), self.width)

    @classmethod
    def of(
        cls,
        shape: tuple[int, ...],
        dtype: Any,
        num_shards: int,
        stacked: int = 0,
        chunks: int = 0,
        align: int = 0,
    ) -> Slot:
        """The geometry of a sliced (or stacked) leaf alone, outside any layout."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        return cls("", shape, dtype, 0, num_shards, stacked, chunks=chunks, align=align)

    def spec(self, axis_name: str) -> P:
        """``PartitionSpec`` of the leaf's global array of pieces (``P()``: owned leaves
        are whole on every device outside the update, but in stage 3)."""
        return P() if self.owned else self.piece_spec(axis_name)

    def piece_spec(self, axis_name: str | tuple[str, ...]) -> P:
        """``PartitionSpec`` of the global array of every device's piece of the leaf,
        ``(..., blocks, pieces of a block)``: over the split's axes and the batch's
        (over ``axis_name``, for a leaf of one block), so that the state says how it
        is cut."""
        ndim, split = len(self.piece_shape), self.split
        return _spec([*[()] * (ndim - 2), split.axes, split.over or axis_name][-ndim:])

    def leaf_spec(self) -> P:
        """``PartitionSpec`` of the leaf where the update runs: its block per device."""
        return self.split.leaf_spec(len(self.shape))

    def cut_over(self, axis_name: str | tuple[str, ...]) -> str | tuple[str, ...]:
        """The axes its block's pieces are cut over: the batch axes (``axis_name``, every
        axis of the state, for a leaf of one block)."""
        return self.split.over or axis_name

    def cut_spec(self, over: tuple[str, ...]) -> P:
        """``PartitionSpec`` of the leaf with its block cut over ``over`` along its first
        dimension after its layer axes, minor to its own split there."""
        entries, k = [()] * len(self.shape), self.stacked
        entries[self.split.dim] = self.split.axes
        entries[k] = (*entries[k], *over)
        return _spec(entries)

    def _padded(self, leaf: jax.Array, flat: bool = False) -> jax.Array:
        """``(layers, num_shards * width)``: each layer raveled and zero-padded (with
        ``flat``, of one layer, that row alone)."""
        rows = jnp.reshape(leaf, (-1,) if flat else (self.layers, -1))
        pad = self.num_shards * self.width - rows.shape[-1]
        return jnp.pad(rows, (*((0, 0),) * (rows.ndim - 1), (0, pad))) if pad else rows

    def padding_mask(self, index: jax.Array | int) -> jax.Array:
        """Which elements of device ``index``'s 1-D piece are the leaf's (not padding)."""
        layer = math.prod(self.held_shape[self.stacked :])
        mine = jnp.arange(self.width) + self.piece_index(index) * self.width < layer
        return jnp.broadcast_to(mine, (self.layers, self.width)).reshape(-1)

    def cut(self, leaf: jax.Array, index: jax.Array | int) -> jax.Array:
        """Device ``index``'s 1-D piece of the full ``leaf``."""
        return self.own(self.split.block(leaf, index % self.split.blocks), index)

    def piece_index(self, index: jax.Array | int) -> jax.Array | int:
        """Which piece of its block device ``index`` holds (no division traced for one)."""
        return index if self.split.blocks == 1 else index // self.split.blocks

    def blocks(self, leaf: jax.Array) -> jax.Array:
        """Every device's piece of ``leaf``: ``(num_shards, piece_size)``, row ``d`` for
        device ``d`` (what a reduce-scatter scatters): of each block ``(pieces of a
        block, piece)``, the blocks minor."""
        rows = [self.moved._rows(self.split.block(leaf, b)) for b in range(self.split.blocks)]
        return rows[0] if len(rows) == 1 else jnp.stack(rows, 1).reshape(self.num_shards, -1)

    @property
    def _in_order(self) -> bool:
        """Whether every device's piece, in device order, is the leaf raveled: unpadded,
        of one layer (or on one device)."""
        layer = math.prod(self.shape[self.stacked :])
        return self.num_shards * self.width == layer and 1 in (self.num_shards, self.layers)

    def _rows(self, leaf: jax.Array) -> jax.Array:
        """:meth:`blocks` of a leaf of one block (a reshape where that is all it is, as
        in :meth:`_joined`)."""
        n = self.num_shards
        if self._in_order:
            return leaf.reshape(n, -1)
        padded = self._padded(leaf)
        if self.layers == 1:
            return padded.reshape(n, self.width)
        return padded.reshape(self.layers, n, self.width).swapaxes(0, 1).reshape(n, -1)

    def uncut(self, pieces: jax.Array) -> jax.Array:
        """The full leaf from every device's piece (``(num_shards, ...)``, row ``d`` from
        device ``d``, as an all-gather returns them): the inverse of :meth:`blocks`."""
        moved, m = self.moved, self.split.blocks
        if m == 1:
            return moved._joined(pieces)
        rows = pieces.reshape(self.num_shards // m, m, -1)
        blocks = [moved._joined(rows[:, b]) for b in range(m)]
        return jnp.concatenate(blocks, self.split.dim)

    def _joined(self, pieces: jax.Array) -> jax.Array:
        """:meth:`uncut` of a leaf of one block. (Each operation traced here is traced
        again per layer in stage 3's backward pass: a reshape where that is all it is.)"""
        if self._in_order:
            return pieces.reshape(self.shape)
        n, layer = self.num_shards, math.prod(self.shape[self.stacked :])
        rows = pieces.reshape(n, self.layers, self.width)
        rows = rows.reshape(n * self.width) if self.layers == 1 else rows.swapaxes(0, 1)
        return rows.reshape(self.layers, -1)[:, :layer].reshape(self.shape)


def _codes(slot: Slot, block: int) -> bool:
    """Whether ``slot``'s per-element state is coded in blocks of ``block``: a sliced
    matrix (two dimensions besides its layer axes) with at least a block per layer
    (of its blocks per layer, for a split leaf)."""
    if not block or slot.owned or slot.blocked or len(slot.shape) - slot.stacked < 2:
        return False
    return math.prod(slot.moved.shape[slot.stacked :]) >= block


def _can_split(slot: Slot, split: Split) -> bool:
    """Whether ``slot``'s state can be kept block by block: it splits a dimension of a
    layer evenly, and its pieces have a unit axis to hold the blocks (two dimensions
    besides the layer axes: a vector's state is gathered whole, it is small)."""
    k, shape = slot.stacked, slot.shape
    return split.dim >= k and len(shape) - k >= 2 and shape[split.dim] % split.blocks == 0


def is_floating(x: Any) -> bool:
    """Whether ``x`` (an array or a scalar) has a floating-point dtype."""
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


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
    """All leaves of one dtype.

    Attributes:
      dtype: the leaves' dtype.
      slots: the indices of its leaves.
      row_size: elements per device of its sliced leaves (one row of an
        ``(num_shards, row_size)`` matrix).
      owned_width: elements of its owned leaves on the most loaded device: the row
        each device has for them is padded to this.
      owned_chunk: elements of one device's stage-3 pieces of the units another
        device owns, for the device owning most (what an ``all_to_all`` between
        pieces and owners moves per pair of devices, padded to this).
    """

    dtype: np.dtype
    slots: tuple[int, ...]
    row_size: int
    owned_width: int = 0
    owned_chunk: int = 0


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
    def from_tree(
        cls,
        tree: PyTree,
        num_shards: int,
        stacked: Stacked = None,
        owned: Mapping[int, float] | None = None,
        layered: Collection[int] | None = None,
        spread: Collection[int] | None = None,
        blocked: Mapping[int, Any] | None = None,
        chunks: int = 0,
        splits: Mapping[int, Split] | None = None,
        align: int = 0,
    ) -> Layout:
        """Lays out ``tree`` over ``num_shards`` devices.

        Args:
          tree: the parameters (arrays or ``jax.ShapeDtypeStruct``).
          num_shards: the number of devices.
          stacked: which leaves hold stacked layers (see :data:`Stacked`).
          owned: the leaves to place whole on one device, by index, with the cost of
            their update: owners are chosen largest cost first, each leaf to the
            device with the least cost so far (ties: fewest bytes, lowest index).
          layered: of the ``owned`` leaves, those owned layer by layer (stacked
            leaves whose update treats each layer on its own): each layer is a unit,
            placed as a whole leaf is, with its share of the leaf's cost.
          spread: of the ``layered`` leaves, those whose layers go first, so that
            each device gets one where there are as many layers as devices.
          blocked: leaves (not ``owned``) updated on blocks, by index, with the
            placement of their blocks (see :attr:`Slot.block`).
          chunks: ``0``, or the number of canonical chunks every layer is cut into
            (see :class:`Slot`; a multiple of ``num_shards``).
          splits: leaves split over the mesh's other axes whose state is kept block by
            block, by index (see :class:`Split`; not for ``owned`` or ``blocked`` ones).
          align: ``0``, or the block of coded state: the pieces of each sliced leaf
            with two dimensions besides its layer axes and at least ``align`` elements
            per layer are a multiple of it wide (:attr:`Slot.align`).

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
        dims = stacked_dims(tree, stacked)
        owners = _owners(path_leaves, num_shards, owned or {}, layered or (), spread or ())
        dtypes: list[np.dtype] = []
        slots = []
        for i, (path, leaf) in enumerate(path_leaves):
            dtype = np.dtype(leaf.dtype)
            name = jax.tree_util.keystr(path)
            if not is_floating(dtype):
                raise TypeError(
                    f"zeroshard shards floating-point parameters only, but leaf {name} has "
                    f"dtype {dtype}. Keep integer or boolean state out of the tree passed "
                    "to the optimizer (e.g. in a separate collection)."
                )
            dtypes += [] if dtype in dtypes else [dtype]
            units, b = owners.get(i, ()), dtypes.index(dtype)
            lay = bool(units) and i in (layered or ())
            slot = Slot(name, tuple(leaf.shape), dtype, b, num_shards, dims[i], units, lay)
            block = (blocked or {}).get(i)
            split = (splits or {}).get(i, WHOLE)
            kept = not (units or block) and _can_split(slot, split)  # (else gathered whole)
            slot = dataclasses.replace(slot, chunks=chunks, block=block, split=(WHOLE, split)[kept])
            slots.append(dataclasses.replace(slot, align=align if _codes(slot, align) else 0))
        buckets = _buckets(slots, dtypes, num_shards)
        return cls(treedef, tuple(slots), tuple(buckets), num_shards)

    def placed(
        self,
        owned: Mapping[int, float] | None = None,
        layered: Collection[int] = (),
        spread: Collection[int] = (),
        blocked: Mapping[int, Any] | None = None,
    ) -> Layout:
        """This layout's leaves placed as :meth:`from_tree` says of ``owned``,
        ``layered``, ``spread`` and ``blocked``, with their layer axes, chunks, splits
        and alignment kept."""
        dims = {s.path: s.stacked for s in self.slots}
        stacked = lambda path, _: dims[path]
        structs, n = self.full_structs(), self.num_shards
        args = (owned, layered, spread, blocked, self.chunks, self.splits, self.align)
        return Layout.from_tree(structs, n, stacked, *args)

    @property
    def chunks(self) -> int:
        """The canonical chunks every layer is cut into (``0``: none; see :class:`Slot`)."""
        return self.slots[0].chunks

    @property
    def align(self) -> int:
        """The block of coded state the pieces are aligned to (``0``: none)."""
        return max(s.align for s in self.slots)

    @property
    def splits(self) -> dict[int, Split]:
        """The split leaves (:attr:`Slot.split`), by index."""
        return {i: s.split for i, s in enumerate(self.slots) if s.split.blocks > 1}

    @property
    def blocked(self) -> tuple[int, ...]:
        """The blocked leaves (:attr:`Slot.block`)."""
        return tuple(i for i, s in enumerate(self.slots) if s.blocked)

    def owned_by(self, device: int) -> tuple[int, ...]:
        """The leaves ``device`` owns (whole, or some of its layers), in leaf order."""
        return tuple(i for i, s in enumerate(self.slots) if device in s.owners)

    def profile(self, device: int) -> tuple[tuple[int, int], ...]:
        """What ``device`` owns, up to which layers: per leaf it owns, the number of its
        units. Devices with one profile see views of the same shapes."""
        return tuple((i, len(self.slots[i].units_of(device))) for i in self.owned_by(device))

    def groups(
        self, pack_bytes: int, order: Sequence[int] | None = None
    ) -> tuple[tuple[int, ...], ...]:
        """The sliced leaves that share one collective: each leaf of at least ``pack_bytes``
        alone, and the smaller leaves of each dtype packed together, in leaf order (or
        in ``order``, a permutation of the leaves), into groups of at most ``pack_bytes``
        (so no packed copy is larger). Split leaves (:attr:`Slot.split`) are reduced
        and gathered within their blocks, so they are packed apart from the others."""
        groups = []
        overs = sorted({s.split.over for s in self.slots}, key=len)  # (the batch axes: last)
        for b, over in [(b, over) for b in self.buckets for over in overs]:
            members = {i for i in b.slots if self.slots[i].split.over == over}
            ordered = b.slots if order is None else order
            sliced = [i for i in ordered if i in members and not self.slots[i].owned]
            nbytes = {i: self.slots[i].size * b.dtype.itemsize for i in sliced}
            run: list[int] = []
            for i in (i for i in sliced if nbytes[i] < pack_bytes):
                if run and sum(nbytes[j] for j in run) + nbytes[i] > pack_bytes:
                    groups.append(tuple(run))
                    run = []
                run.append(i)
            groups += [tuple(run)] if run else []
            groups += [(i,) for i in sliced if nbytes[i] >= pack_bytes]
        return tuple(groups)

    def collective_widths(
        self, pack_bytes: int, order: Sequence[int] | None = None
    ) -> list[tuple[int, list[int]]]:
        """Per collective of a step (each group of :meth:`groups`, then each bucket's
        owned rows), the devices it runs over (a split leaf's group: the batch axes'
        alone) and the widths of the parts it moves per device."""
        sizes = lambda g: [self.slots[i].piece_size for i in g]
        widths = [
            (self.slots[g[0]].moved.num_shards, sizes(g)) for g in self.groups(pack_bytes, order)
        ]
        return widths + [(self.num_shards, [b.owned_width]) for b in self.buckets if b.owned_width]

    def full_structs(self, dtypes: Sequence[Any] | None = None, pieces: bool = False) -> PyTree:
        """A tree of ``ShapeDtypeStruct`` full leaves, or with ``pieces`` of one
        device's pieces (bucket ``b`` in ``dtypes[b]``)."""
        return self.treedef.unflatten(
            jax.ShapeDtypeStruct(
                s.piece_shape if pieces else s.shape,
                s.dtype if dtypes is None else dtypes[s.bucket],
            )
            for s in self.slots
        )

    def check_matches(self, tree: PyTree, what: str, full: bool = False) -> None:
        """Raises a ``ValueError`` naming the first leaf where ``tree`` differs from the
        leaves as the update holds them (:attr:`Slot.held_shape`), or with ``full``
        from their full shapes."""
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"{what} do not have the parameters' tree structure:\n  {treedef}\n"
                f"vs params:\n  {self.treedef}"
            )
        for (path, leaf), slot in zip(path_leaves, self.slots, strict=True):
            shape = slot.shape if full else slot.held_shape
            if tuple(leaf.shape) != shape:
                raise ValueError(
                    f"{what} leaf {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, "
                    f"but the parameter has shape {shape}."
                )

    # The sliced/owned difference of a per-leaf list, said once.

    def sliced(self, fn: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
        """``fn(slot, *xs)`` for each sliced leaf (``xs``: its item of each of the
        per-leaf ``columns``), ``None`` for each owned leaf."""
        return [None if s.owned else fn(s, *x) for s, *x in zip(self.slots, *columns, strict=True)]

    def owned(self, fn: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
        """``fn(slot, *xs)`` for each owned leaf, ``None`` for each sliced leaf."""
        return [fn(s, *x) if s.owned else None for s, *x in zip(self.slots, *columns, strict=True)]

    def per_owned_bucket(self, fn: Callable[[int, Bucket], Any]) -> tuple[Any, ...]:
        """``fn(b, bucket)`` for each bucket with owned leaves, ``None`` for the others."""
        return tuple(fn(b, x) if x.owned_width else None for b, x in enumerate(self.buckets))

    # Full leaves -> this device's pieces and rows.

    def pieces(self, tree: PyTree, index: jax.Array | int) -> list[jax.Array | None]:
        """Device ``index``'s 1-D piece of every sliced leaf of ``tree`` (the leaves as
        the update holds them: see :meth:`Slot.own`); ``None`` for owned leaves."""
        return self.sliced(lambda s, x: s.own(x, index), self.treedef.flatten_up_to(tree))

    def leaf_specs(self) -> PyTree:
        """``PartitionSpec`` of every leaf where the update runs (:meth:`Slot.leaf_spec`)."""
        return self.treedef.unflatten([s.leaf_spec() for s in self.slots])

    # Owned leaves: each device's row of the whole leaves it owns, per bucket.

    def owned_row(
        self, local: Sequence[Any], device: int, bucket: int, dtype: Any, width: int = 0
    ) -> jax.Array:
        """``device``'s row of bucket ``bucket`` in ``dtype``: its units of the owned
        leaves (``local[i]``: what :meth:`Slot.local` gives for ``device``) raveled end
        to end and zero-padded to ``width`` (default ``owned_width``)."""
        own = [local[i] for i in self.owned_by(device) if self.slots[i].bucket == bucket]
        return pack(own, dtype, width or self.buckets[bucket].owned_width)

    def owned_blocks(
        self, leaves: Sequence[Any], bucket: int, dtype: Any, pieces: bool = False
    ) -> jax.Array:
        """Every device's owned row of ``bucket`` from the full ``leaves``:
        ``(num_shards, owned_width)``, row ``d`` for device ``d`` (what a reduce-scatter
        scatters). With ``pieces``, from this device's 1-D pieces of every leaf
        instead: ``(num_shards, owned_chunk)``, row ``d`` its pieces of the units
        device ``d`` owns (what an ``all_to_all`` sends to ``d``, stage 3)."""
        width = self.buckets[bucket].owned_chunk if pieces else 0
        units = lambda x, s: x.reshape(s.layers, s.width) if pieces and s.layered else x
        local = lambda d: [
            s.local(units(x, s), d) if d in s.owners and s.bucket == bucket else None
            for x, s in zip(leaves, self.slots, strict=True)
        ]
        rows = [self.owned_row(local(d), d, bucket, dtype, width) for d in range(self.num_shards)]
        return jnp.stack(rows)

    def owned_local(self, row: jax.Array, i: int, device: int, pieces: bool = False) -> jax.Array:
        """``device``'s units of owned leaf ``i``, from its owned row; with ``pieces``,
        from every device's pieces of them (``(num_shards, owned_chunk)``, row ``d``
        from device ``d``, what the ``all_to_all`` to the owners brings)."""
        s = self.slots[i]
        whole = s.unit_geometry().uncut if pieces else lambda x: x.reshape(s.unit_shape)
        units = [whole(row[..., a:b]) for d, a, b in s.unit_spans(pieces) if d == device]
        return jnp.stack(units) if s.layered else units[0]

    def owned_full(self, rows: jax.Array, i: int) -> jax.Array:
        """Owned leaf ``i`` from every device's owned row (``(num_shards, owned_width)``)."""
        s = self.slots[i]
        units = [rows[d, a:b].reshape(s.unit_shape) for d, a, b in s.unit_spans()]
        return jnp.stack(units) if s.layered else units[0]


def _buckets(slots: list[Slot], dtypes: list[np.dtype], num_shards: int) -> list[Bucket]:
    """The buckets of ``slots`` (one per dtype), each owned slot given its units'
    offsets in their owners' owned rows (updated in place)."""
    buckets = []
    for b, dtype in enumerate(dtypes):
        members = tuple(i for i, s in enumerate(slots) if s.bucket == b)
        # Per device, its owned row's and its stage-3 chunk's end so far.
        ends, chunks = [0] * num_shards, [0] * num_shards
        for i in (i for i in members if slots[i].owned):
            s = slots[i]
            offsets = []
            for d in s.owners:
                offsets.append((ends[d], chunks[d]))
                ends[d] += math.prod(s.unit_shape)
                chunks[d] += s.unit_piece
            unit_offsets, chunk_offsets = (tuple(o) for o in zip(*offsets, strict=True))
            slots[i] = dataclasses.replace(
                s, unit_offsets=unit_offsets, chunk_offsets=chunk_offsets
            )
        row = sum(slots[i].piece_size for i in members if not slots[i].owned)
        buckets.append(Bucket(dtype, members, row, max(ends), max(chunks)))
    return buckets


def _owners(
    path_leaves: list,
    num_shards: int,
    costs: Mapping[int, float],
    layered: Collection[int],
    spread: Collection[int],
) -> dict[int, tuple[int, ...]]:
    """The owner of each unit of each owned leaf (the leaf, or each of its layers where
    ``layered``): the layers of ``spread`` leaves first, then largest cost first, each
    to the least loaded device (ties: fewest bytes, lowest index)."""
    units = []  # (cost, leaf, unit, bytes)
    for i, cost in costs.items():
        leaf = path_leaves[i][1]
        n = leaf.shape[0] if i in layered else 1
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // n
        units += [(cost / n, i, u, nbytes) for u in range(n)]
    load = [(0.0, 0, d) for d in range(num_shards)]  # (cost, bytes, device)
    owners: dict[int, list[int]] = {i: [] for i in costs}
    for cost, i, _, nbytes in sorted(units, key=lambda x: (x[1] not in spread, -x[0], x[1], x[2])):
        done, held, d = min(load)
        owners[i].append(d)
        load[d] = (done + cost, held + nbytes, d)
    return {i: tuple(o) for i, o in owners.items()}
