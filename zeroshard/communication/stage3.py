"""Stage 3: weights kept as 1/N pieces, gathered layer by layer just before use.

In a stage-3 :class:`zeroshard.TrainState` every parameter is a :class:`Piece`: this
device's piece of the raveled leaf (the same piece the optimizer state uses), plus the
leaf's full shape and dtype as static data. A loss function calls :func:`gather` on
one layer's parameters right before the layer. That is one ``all_gather`` per dtype
for the whole layer. Autodiff transposes the all-gather into a reduce-scatter, so the
gradient of each piece arrives already reduced (summed over devices). Wrap a layer in
:func:`layer` so its gathered weights are recomputed in the backward pass instead of
saved. Then no device ever holds all the weights at once.

Example:
    >>> import jax.numpy as jnp, zeroshard as zs
    >>> def loss_fn(params, batch):          # params: a tree of zs.Piece (stage 3)
    ...     x = batch["x"]
    ...     for p in params["layers"]:
    ...         x = zs.layer(lambda w, x: jnp.tanh(x @ w["w"] + w["b"]))(p, x)
    ...     return jnp.mean((x - batch["y"]) ** 2)

Stacked layers (``zs.sharded(inner, stacked=["blocks"])``, a leading layer axis)
are cut layer by layer, so a scan over them gathers one layer per iteration::

    def loss_fn(params, batch):
        block = zs.layer(lambda w, x: jnp.tanh(x @ w["w"]))
        x, _ = jax.lax.scan(lambda x, w: (block(w, x), None), batch["x"], params["blocks"])
        return jnp.mean((x - batch["y"]) ** 2)

:func:`layers` is that scan, with each layer's weights gathered while the layer
before runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroshard.analysis.reads import is_marking, mark
from zeroshard.communication import jit_gather
from zeroshard.communication.collectives import all_gathered_parts, axes_of, from_bits, is_identity
from zeroshard.core.layout import Layout, PyTree, Slot, Split, is_floating
from zeroshard.core.mesh import axis_of_step, current_step, on_mesh, own_layout
from zeroshard.core.rows import pack
from zeroshard.measuring.scopes import GATHER, scope


@jax.tree_util.register_pytree_node_class
class Piece:
    """This device's piece of a parameter, with the parameter's record.

    Attributes:
      piece: the piece, shaped ``(1, ..., 1, ceil(size / N))`` on a device (inside
        ``shard_map``), or ``(layers, 1, ..., width)`` for a stacked leaf; outside,
        the global array of all pieces.
      leaf: the parameter's :class:`zeroshard.core.layout.Slot` (static): its full shape,
        dtype, layer axes and geometry over the devices (a tensor-parallel
        parameter's smaller block folded in).
      shape: the parameter's shape. For a stacked parameter scanned over (or
        indexed) along its layer axes, the shape of the layer the piece now holds.
      dtype: the parameter's dtype.
      stacked: the number of leading layer axes the piece still holds.
    """

    def __init__(self, piece: Any, leaf: Slot):
        self.piece, self.leaf = piece, leaf

    @property
    def dtype(self) -> np.dtype:
        return self.leaf.dtype

    @property
    def _taken(self) -> int:
        """Leading layer axes taken off the piece (by a scan or an index) since it was
        laid out (beyond them: ``-1``)."""
        ndim, rank = getattr(self.piece, "ndim", None), len(self.leaf.shape)
        dropped = 0 if ndim is None else rank - max(ndim, 1) + (not rank)
        return dropped if 0 <= dropped <= self.leaf.stacked else -1

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape[max(self._taken, 0) :]

    @property
    def stacked(self) -> int:
        return self.leaf.stacked - max(self._taken, 0)

    @property
    def split(self) -> Split:
        """The leaf's split, its dimension counted in :attr:`shape`."""
        split = self.leaf.split
        return dataclasses.replace(split, dim=max(split.dim - max(self._taken, 0), 0))

    def slot(self, num_shards: int, local: bool = True) -> Slot:
        """The piece's geometry over ``num_shards`` devices (of the layer it holds,
        where a scan or an index took layer axes off); not ``local``: of the global
        array of every device's piece, its shape unchecked.

        Raises:
          ValueError: if the piece lost axes that are not stacked layer axes, or does
            not have the shape the layout gives it (e.g. it was scanned over, indexed
            or vmapped in a way the layout does not support).
        """
        s = self.leaf
        slot = Slot.of(self.shape, s.dtype, num_shards, self.stacked, s.chunks, s.align)
        slot = dataclasses.replace(slot, split=self.split)
        if self._taken < 0 or (local and tuple(self.piece.shape) != slot.piece_shape):
            how = (
                f"laid out with {s.stacked} stacked layer axes"
                if s.stacked
                else "not laid out as stacked layers"
            )
            raise ValueError(
                f"a stage-3 parameter of shape {s.shape} has a piece of shape "
                f"{tuple(self.piece.shape)} here, but it is {how}, so this piece cannot be "
                "gathered (was it scanned over, indexed or vmapped?). To scan over stacked "
                "layers, mark them: zs.sharded(inner, stacked=['<name of the stacked "
                "subtree>']), and scan over the leading axis of that subtree."
            )
        return slot

    def tree_flatten(self):
        return (self.piece,), self.leaf

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], aux)

    def __getitem__(self, index: Any) -> jax.Array:
        return self.__jax_array__()[index]

    def __jax_array__(self) -> jax.Array:
        """The whole parameter, for code that reads it as an array without a mark. In
        your own ``jax.jit`` (the drop-in's stage 3) the compiler gathers it where it
        is read, as it does a weight laid out in its own shape; in zeroshard's step,
        where a read outside ``zs.gather`` / ``zs.layer`` would keep every weight whole
        for the whole step, it is refused."""
        if jit_gather.in_users_jit():
            return gather(self)
        raise TypeError(
            f"a stage-3 parameter of shape {self.shape} is only this device's piece: call "
            "zs.gather(layer_params) (or wrap the layer in zs.layer) before using it."
        )

    def __repr__(self) -> str:
        piece = getattr(self.piece, "shape", self.piece)
        stacked = f", stacked={self.stacked}" if self.stacked else ""
        return f"Piece(shape={self.shape}, dtype={self.dtype.name}, piece={piece}{stacked})"


@jax.tree_util.register_pytree_node_class
class Held(Piece):
    """A stage-2 parameter as a loss that gathers receives it (:mod:`zeroshard.training.held`):
    this device's piece, laid out as a stage-3 :class:`Piece`'s, and the whole
    parameter, replicated. :func:`gather` returns the whole parameter with no
    collective; its transpose sends the cotangent to the piece as the transpose of the
    step's stage-3 gather does (a reduce-scatter per gather).

    Attributes:
      full: the whole parameter (for a stacked parameter scanned over, the layer the
        piece holds).
    """

    def __init__(self, piece: Any, full: Any, leaf: Slot):
        super().__init__(piece, leaf)
        self.full = full

    def tree_flatten(self):
        (piece,), aux = super().tree_flatten()
        return (piece, self.full), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    def __repr__(self) -> str:
        return "Held" + super().__repr__().removeprefix("Piece")


def is_shard(x: Any) -> bool:
    return isinstance(x, Piece)


def full_structs(params: PyTree) -> PyTree:
    """``ShapeDtypeStruct`` of the full parameters (``Piece`` leaves or arrays)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params, is_leaf=is_shard)


def to_shards(layout: Layout, pieces: list[jax.Array]) -> PyTree:
    """Stage-3 parameters: this device's 1-D piece of every leaf (owned ones too: their
    owners gather them for the update) -> :class:`Piece` pieces, in the parameters'
    dtypes."""
    return layout.treedef.unflatten(
        Piece(p.astype(s.dtype).reshape(s.piece_shape), s)
        for p, s in zip(pieces, layout.slots, strict=True)
    )


def shard_specs(layout: Layout, axis_name: str) -> PyTree:
    """``PartitionSpec`` of every stage-3 parameter: a :class:`Piece` of its piece's spec."""
    return layout.treedef.unflatten(Piece(s.piece_spec(axis_name), s) for s in layout.slots)


def layout_of(params: PyTree, axes: Collection[str]) -> PyTree:
    """The parameters' own layout over ``axes`` (the mesh's axes besides the batch's),
    a ``PartitionSpec`` per leaf: their arrays' (:func:`zeroshard.core.mesh.own_layout`),
    or for stage-3 pieces how they are cut: a split leaf's by its blocks
    (:class:`zeroshard.core.layout.Split`), ``P()`` for the others."""
    spec = lambda x: x.split.leaf_spec(len(x.shape)) if is_shard(x) else own_layout(x, axes)
    return jax.tree.map(spec, params, is_leaf=is_shard)


def gather(tree: PyTree, axis_name: str | None = None) -> PyTree:
    """Replaces every :class:`Piece` in ``tree`` by the full parameter.

    One ``all_gather`` per dtype for the whole tree (call it once per layer), in the
    parameters' dtype. Inside ``shard_map`` over ``axis_name``; in a plain
    ``jax.jit`` (the drop-in's ``zs.sharded(inner, stage=3)``, whose weights are
    global arrays cut 1/N), it makes each array whole where it is called
    (:mod:`zeroshard.communication.jit_gather`). A stacked
    parameter gathers all its layers; inside a scan over its layer axis, one layer.

    Args:
      tree: a pytree whose leaves are ``Piece`` (other leaves pass through).
      axis_name: the axis the pieces are spread over; ``None`` (default): the axis of
        the zeroshard step whose loss calls it (:func:`zeroshard.make_train_step`, the
        Flax steps). In a hand-written ``shard_map``, name it.

    Returns:
      The same tree with full arrays for the shards. Differentiating through it
      reduce-scatters the cotangents back onto the pieces. In a stage-2 step the
      leaves are :class:`zeroshard.communication.stage3.Held`: the whole weights come with no
      collective, and the cotangents are reduce-scattered the same way
      (:mod:`zeroshard.training.held`). The gather runs in the named scope
      ``zeroshard/gather``; its transpose, the gradients' reduce-scatter, in
      ``transpose(jvp(zeroshard/gather))`` (see :mod:`zeroshard.measuring.scopes`).

    Raises:
      ValueError: if a piece cannot be gathered in the layout it has here (e.g. a
        parameter not marked stacked was scanned over); if ``axis_name`` is ``None``
        outside a zeroshard step.
    """
    if jit_gather.in_users_jit():  # (the drop-in's stage 3)
        return jit_gather.gather(tree, axis_name, is_shard)
    axis_name = axis_of_step(axis_name, "zs.gather")
    with scope(GATHER):
        return _gather(tree, axis_name)


def _gather(tree: PyTree, axis_name: str) -> PyTree:
    """:func:`gather`, inside its named scope: as the step being traced gathers
    (:attr:`zeroshard.core.update.Route.gather`), else exactly; :class:`Held` leaves with
    no collective (:func:`held`)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
    if is_marking():  # (a loss traced to read its gathers: zeroshard.analysis.reads)
        return treedef.unflatten(x if is_shard(x) else mark(x) for x in leaves)
    shards = [i for i, x in enumerate(leaves) if is_shard(x)]
    if not shards:  # (whole weights, at stages 1 and 2: nothing to gather, on any axis)
        return tree
    out, step = dict(enumerate(leaves)), current_step()
    gathered, rest = (exact_gather, ()) if step is None else (step.gather, step.rest)
    whole = lambda xs: wholes(xs, axis_name, rest, gathered)
    if rest:  # (pieces cut over the other axes too: manual over them as well)
        whole = over_rest(whole, [leaves[i] for i in shards], axis_name, rest)
    out.update(zip(shards, whole([leaves[i] for i in shards]), strict=True))
    return treedef.unflatten(out.values())


def wholes(
    shards: list[Piece], axis_name: str, rest: tuple[str, ...], gathered: Callable[..., list]
) -> list[jax.Array]:
    """The full parameter of each of ``shards`` (one collective per dtype, by
    ``gathered``, over ``axis_name``); :class:`Held` ones with no collective
    (:func:`held`). With ``rest``, manual over those axes too, where the pieces are
    cut over them as well: a split leaf's pieces give the device's block of it, the
    others are first gathered over ``rest`` as invariant (a gradient arriving the same
    on each of those devices is sliced there, not summed), one collective per dtype
    for each of the two kinds."""
    n = math.prod(jax.lax.axis_size(a) for a in (*axes_of(axis_name), *rest))
    slots = [x.slot(n) for x in shards]
    out: list[Any] = [None] * len(shards)
    # (the split leaves' pieces vary over rest, the others' gathered there do not: apart)
    kind = lambda x: (x.dtype, is_held(x), x.split.axes)
    for key in dict.fromkeys(map(kind, shards)):
        (dtype, whole, _), group = key, [k for k, x in enumerate(shards) if kind(x) == key]
        # (the pieces as given: float32 in a fixed-order step, so the gradients' sums
        # stay float32)
        raw = [jnp.ravel(shards[k].piece) for k in group]
        if whole:
            fulls = [shards[k].full for k in group]
            every = held(raw, fulls, [slots[k] for k in group], axis_name, dtype, gathered)
        else:
            raw = [within(p, slots[k], rest) for p, k in zip(raw, group, strict=True)]
            every = every_piece(raw, axis_name, dtype, gathered)
            moved = [slots[k].moved for k in group]  # (a split leaf's block)
            every = [s.uncut(x) for x, s in zip(every, moved, strict=True)]
        for k, x in zip(group, every, strict=True):
            out[k] = x
    return out


def within(piece: jax.Array, slot: Slot, axes: tuple[str, ...]) -> jax.Array:
    """What this device gathers over the batch axes of its 1-D ``piece``: its piece
    with every device's along those of the state's other ``axes`` its block does not
    span, gathered as the same on each (its transpose slices the gradient there
    instead of summing it)."""
    across = tuple(a for a in axes if a not in slot.split.axes)
    return jax.lax.all_gather(piece, across, tiled=True, to="invarying") if across else piece


def over_rest(
    whole: Callable[[list], list], shards: list[Piece], axis_name: str, rest: tuple[str, ...]
) -> Callable[[list], list]:
    """``whole`` run manual over the state's other axes ``rest`` too (in a step manual
    over the batch axes only): each of ``shards`` comes in as this device's piece,
    and leaves laid out over ``rest`` as the parameter is, a split leaf by its blocks,
    another replicated."""
    entry = rest  # (a tuple of one axis is that axis)
    spanned = lambda x: len(x.split.axes) > 0  # (a split leaf's blocks: its piece's unit axis)
    piece = lambda x: P(*(None,) * (x.piece.ndim - 1 - spanned(x)), entry, *(None,) * spanned(x))
    specs = [jax.tree.map(lambda _, x=x: piece(x), x) for x in shards]  # (x's own aux)
    outs = [x.split.leaf_spec(len(x.shape)) for x in shards]
    mesh = jax.sharding.get_abstract_mesh()
    many = math.prod(mesh.shape[a] for a in (*axes_of(axis_name), *rest)) > 1
    return jax.shard_map(
        whole, in_specs=(specs,), out_specs=outs, axis_names=set(rest), check_vma=many
    )


def every_piece(
    pieces: list[jax.Array], axis_name: str, dtype: Any, gathered: Callable[..., list]
) -> list[jax.Array]:
    """Every device's piece of each of the 1-D ``pieces`` in ``dtype``, by ``gathered``
    (row ``d`` from device ``d``); on one device, each piece is the whole leaf."""
    if is_identity(pieces, axis_name):
        return [p.astype(dtype)[None] for p in pieces]
    return gathered(pieces, axis_name, dtype)


def is_held(x: Any) -> bool:
    return isinstance(x, Held)


def held(
    pieces: list[jax.Array],
    fulls: list[jax.Array],
    slots: list[Slot],
    axis_name: str,
    dtype: Any,
    gathered: Callable[..., list],
) -> list[jax.Array]:
    """``fulls`` in ``dtype``, with no collective: the forward pass of a :class:`Held`
    gather. The transpose sends their cotangents to the 1-D ``pieces`` (this device's
    of each leaf, by ``slots``) through the transpose of ``gathered`` (the step's
    stage-3 gather, :attr:`zeroshard.core.update.Route.gather`): a reduce-scatter, in the
    pieces' dtype, of this gather's leaves only."""

    def gather_pieces(pieces: list[jax.Array]) -> list[jax.Array]:
        every = every_piece(pieces, axis_name, pieces[0].dtype, gathered)
        return [s.uncut(x).astype(dtype) for s, x in zip(slots, every, strict=True)]

    @jax.custom_vjp
    def whole(pieces: list[jax.Array], fulls: list[jax.Array]) -> list[jax.Array]:
        return [from_bits(f, s.dtype).astype(dtype) for s, f in zip(slots, fulls, strict=True)]

    def forward(pieces: list[jax.Array], fulls: list[jax.Array]) -> tuple:
        return whole(pieces, fulls), pieces

    def backward(pieces: list[jax.Array], cotangents: list[jax.Array]) -> tuple:
        # (the vjp's forward all-gather has no use and is left out by the compiler)
        return jax.vjp(gather_pieces, pieces)[1](cotangents)[0], None

    whole.defvjp(forward, backward)
    return whole(pieces, fulls)


def exact_gather(pieces: list[jax.Array], axis_name: str, dtype: Any) -> list[jax.Array]:
    """Every device's piece of each of ``pieces`` in ``dtype``, exactly: the default
    stage-3 gather (:attr:`zeroshard.core.update.Route.gather`)."""
    return all_gathered_parts([p.astype(dtype) for p in pieces], axis_name)


def layer(
    fn: Callable[..., Any], axis_name: str | None = None, reduce_scatter: bool = False
) -> Callable[..., Any]:
    """``fn(gather(params), *args)``, with the weights gathered again in the backward pass.

    Args:
      fn: ``fn(full_params, *args)``: one layer's computation.
      axis_name: the axis the pieces are spread over; ``None`` (default): the axis of
        the zeroshard step the layer runs in (see :func:`gather`).
      reduce_scatter: in your own ``jax.jit``, the backward pass runs manual over the
        batch axis: every device differentiates its rows of ``args`` (the leading
        dimension of each) and the weight gradient's partial sums are
        reduce-scattered onto the pieces, ZeRO-3's bytes (without it the gradient
        ``jax.grad`` reduced is sliced: an all-reduce). Only for a row-independent
        ``fn``: each row of its output depends on the same row of ``args`` alone (an
        embedding lookup, a matmul; no statistic over the batch, no sharding call
        naming the batch axis).

    Returns:
      ``wrapped(params, *args)`` taking the layer's ``Piece`` tree. Only the pieces
      and ``args`` are kept for the backward pass. That pass gathers the weights again
      and differentiates ``fn``: the stage-3 trade of memory for bandwidth.
    """

    def run(params: PyTree, *args: Any) -> Any:
        if jit_gather.in_users_jit():
            return fn(jit_gather.gather(params, axis_name, is_shard), *args)
        return fn(gather(params, axis_of_step(axis_name, "zs.layer")), *args)

    @jax.custom_vjp
    def wrapped(params: PyTree, *args: Any) -> Any:
        return run(_after(params, args), *args)

    def forward(params: PyTree, *args: Any) -> tuple[Any, tuple[PyTree, tuple]]:
        return run(_after(params, args), *args), (params, args)

    def backward(residuals: tuple[PyTree, tuple], cotangent: Any) -> tuple:
        params, args = residuals
        if reduce_scatter and jit_gather.in_users_jit():
            w = jit_gather.gather(_after(params, cotangent), axis_name, is_shard)
            grads, arg_grads = _scattered(fn, w, args, cotangent, axis_name, params)
        else:
            grads, *arg_grads = jax.vjp(run, _after(params, cotangent), *args)[1](cotangent)
        # The cotangents flowing on to earlier layers wait for this layer's weight
        # gradients, so each layer's full-size gradient is reduce-scattered (and freed)
        # before the next one is made.
        return (grads, *_after(tuple(arg_grads), grads))

    wrapped.defvjp(forward, backward)
    return wrapped


def layers(
    fn: Callable[[PyTree, Any], Any], axis_name: str | None = None, reduce_scatter: bool = False
) -> Callable:
    """A scan of :func:`layer` over stacked layers that prefetches: layer ``l + 1``'s
    weights are gathered before layer ``l`` runs, and in the backward pass layer
    ``l - 1``'s before layer ``l``'s gradient is made (where collectives run
    asynchronously, as on GPU and TPU, each gather then overlaps a layer's compute).
    Two layers' whole weights are held at a time, never the stack's.

    Args:
      fn: ``fn(layer_params, x) -> x``: one layer (``x`` a pytree of a fixed type).
      axis_name: as for :func:`gather`.
      reduce_scatter: as for :func:`layer`, each layer's backward pass.

    Returns:
      ``run(stacked_params, x)``: ``x`` through every layer of ``stacked_params`` (a
      leading layer axis on each leaf), as
      ``jax.lax.scan(lambda x, w: (layer(fn)(w, x), None), x, stacked_params)[0]``.
    """
    take = lambda tree, i: jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree
    )
    whole = lambda tree, anchor: gather(jax.lax.optimization_barrier((tree, anchor))[0], axis_name)

    def forward(stack: PyTree, x: Any) -> tuple[Any, tuple]:
        def body(carry: tuple, i: Any) -> tuple:
            y = fn(carry[1], carry[0])
            return (y, whole(take(stack, i + 1), carry[0])), y

        steps = jnp.arange(len(jax.tree.leaves(stack)[0]) - 1)
        (y, w), outs = jax.lax.scan(body, (x, whole(take(stack, 0), x)), steps)
        return fn(w, y), (stack, x, outs)  # (outs[l]: layer l + 1's input)

    def backward(residuals: tuple, g: Any) -> tuple:
        stack, x, outs = residuals

        def grad(w: PyTree, x: Any, g: Any, i: Any, grads: PyTree) -> tuple:
            if reduce_scatter and jit_gather.in_users_jit():
                dw, (g,) = _scattered(fn, w, (x,), g, axis_name, take(stack, i))
            else:
                dw, g = jax.vjp(fn, w, x)[1](g)
                dw = jax.vjp(lambda p: gather(p, axis_name), take(stack, i))[1](dw)[0]
            put = lambda a, d: (
                jax.lax.dynamic_update_index_in_dim(a, d, i, 0) if is_floating(a) else a
            )
            return _after(g, dw), jax.tree.map(put, grads, dw)

        def body(carry: tuple, step: tuple) -> tuple:
            (g, grads, w), (i, x) = carry, step
            behind = whole(take(stack, i - 1), g)
            return (*grad(w, x, g, i, grads), behind), None

        n, grads = len(jax.tree.leaves(stack)[0]), jax.tree.map(jnp.zeros_like, stack)
        start = (g, grads, whole(take(stack, n - 1), g))
        (g, grads, w), _ = jax.lax.scan(body, start, (jnp.arange(1, n), outs), reverse=True)
        g, grads = grad(w, x, g, 0, grads)
        zero = lambda a: a if is_floating(a) else np.zeros(a.shape, jax.dtypes.float0)
        return jax.tree.map(zero, grads), g

    prefetched = jax.custom_vjp(lambda stack, x: forward(stack, x)[0])
    prefetched.defvjp(forward, backward)

    def run(stack: PyTree, x: Any) -> Any:
        if is_marking():  # (a loss traced to read its gathers: read as the scan it is)
            return jax.lax.scan(lambda x, w: (layer(fn, axis_name)(w, x), None), x, stack)[0]
        return prefetched(stack, x)

    return run


def _scattered(
    fn: Callable, w: PyTree, args: tuple, g: Any, axis_name: str | None, pieces: PyTree
) -> tuple[PyTree, tuple]:
    """``fn``'s vjp at ``(w, *args)`` for the cotangent ``g``, manual over the batch
    axis: each device differentiates its rows (the leading dimension of ``args`` and
    ``g``), and the weight gradient's partial sums are reduce-scattered onto the
    ``pieces`` (a padded one's :class:`Piece` from every device's padded piece;
    summed whole for a leaf given whole).

    Raises:
      ValueError: for an argument with no leading dimension the devices divide.
    """
    mesh = jit_gather.mesh_of(jax.tree.leaves(pieces)[0])
    axis = axis_name or tuple(mesh.axis_names)
    n = math.prod(mesh.shape[a] for a in axes_of(axis))
    if odd := [jnp.shape(x) for x in jax.tree.leaves(args) if jnp.ndim(x) < 1 or len(x) % n]:
        raise ValueError(
            f"zs.layer(fn, reduce_scatter=True) got an argument of shape {odd[0]}: each is "
            f"split over {axis!r} ({n} devices) by its rows, its leading dimension. Pass "
            "the batch's rows alone (a constant closed over by fn; a weight in its "
            "params), or leave reduce_scatter off."
        )

    def spec(p: Any) -> Any:
        if is_shard(p):  # (a padded weight: its pieces, of the layer it holds)
            s = p.slot(p.leaf.num_shards, local=False)
            return Piece(s.piece_spec(axis), s)
        return P(axis) if jit_gather.is_cut(p, axes_of(axis), mesh) else P()

    def scatter(d: jax.Array, s: Any) -> Any:
        if is_shard(s):  # (every device's piece, padded, reduce-scattered)
            rows = jax.lax.psum_scatter(s.leaf.blocks(d), axis, tiled=True)
            return Piece(rows.reshape(s.leaf.piece_shape), s.leaf)
        return jax.lax.psum_scatter(d, axis, tiled=True) if s else jax.lax.psum(d, axis)

    specs = jax.tree.map(spec, pieces, is_leaf=is_shard)

    def local(w: PyTree, args: tuple, g: Any) -> tuple:
        dw, *dargs = jax.vjp(fn, jax.lax.pcast(w, axis, to="varying"), *args)[1](g)
        return jax.tree.map(scatter, dw, specs), tuple(dargs)

    run = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=(specs, P(axis))
    )
    dw, dargs = run(w, args, g)
    leaf = lambda p, d: Piece(d.piece, p.leaf) if is_shard(p) else d  # (its own record)
    return jax.tree.map(leaf, pieces, dw, is_leaf=is_shard), dargs


def _after(tree: PyTree, anchor: PyTree) -> PyTree:
    """``tree`` plus an exact zero computed from ``anchor``: the same values, but a data
    dependency the compiler must respect. It orders the gathers of stage 3 layer by
    layer (a gather can neither run before its layer is reached, nor be merged with its
    forward twin, which would keep every layer's weights alive until the backward)."""
    if is_marking():  # (a loss traced to read its gathers: the tie would read the weights)
        return tree
    spec = lambda x: getattr(jax.typeof(x).sharding, "spec", P())
    # (a partial sum, typed unreduced, gives no zero its type allows)
    leaves = [x for x in jax.tree.leaves(anchor) if is_floating(x) and not spec(x).unreduced]
    if not leaves:
        return tree
    whole = [x for x in leaves if not any(spec(x).partitions)]
    cut = [x for x in leaves if any(spec(x).partitions)]
    # (one element of each whole one, and each laid out over an Explicit axis, where
    # one element cannot be cut, summed: every leaf must be made first. In your own
    # jax.jit the compiler reduces each gradient leaf apart, and merged the reductions
    # of several layers where one leaf alone was tied, every layer's gradient then
    # alive at once; in zeroshard's step a layer's reductions are one collective per
    # dtype, and one leaf ties them. XLA's CPU pipeline drops optimization barriers
    # before it combines collectives.)
    if not jit_gather.in_users_jit():
        whole, cut = whole[:1], [] if whole else cut
    zeros = [0 * jnp.ravel(x)[0] for x in whole]
    zeros += [_local_zero(cut, [spec(x) for x in cut])] if cut else []
    zero = sum(zeros[1:], zeros[0])

    def tie(x: Any) -> Any:
        if is_held(x):  # (its whole weights come with no collective: nothing to order)
            return x.tree_unflatten(x.tree_flatten()[1], (tie(x.piece), x.full))
        if is_floating(x):
            return x + zero.astype(jnp.result_type(x))
        return x

    return jax.tree.map(tie, tree, is_leaf=is_held)


def _local_zero(xs: list[jax.Array], specs: list[P]) -> jax.Array:
    """An exact zero from the sum of this device's block of each of ``xs`` (laid out
    as ``specs`` over Explicit axes): every device's is zero, so nothing moves (a
    global sum was one all-reduce per leaf, which the compiler then spent seconds
    combining). A sum, not one element: the compiler computes a slice of a product
    alone, and the tie would then wait for one element's."""
    mesh = jax.typeof(xs[0]).sharding.mesh
    sums = lambda *blocks: sum(0 * jnp.sum(b) for b in blocks)
    return on_mesh(sums, mesh, mesh.axis_names, (tuple(specs), P()), check_vma=False)(*xs)


# Owned leaves in stage 3: their weights and gradients are pieces like the sliced
# leaves'; one all_to_all per bucket moves them between the pieces and the owners.


def exchange(blocks: Sequence[jax.Array | None], axis_name: str) -> tuple[jax.Array | None, ...]:
    """Stage 3: per bucket, row ``d`` of this device's ``(num_shards, owned_chunk)``
    blocks goes to device ``d``, which gets one row from each device (one
    ``all_to_all`` per bucket with owned leaves; see :func:`to_owners` and
    :func:`piece_blocks` for what the rows hold)."""
    to_all = lambda x: (
        x if is_identity(x, axis_name) else jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)
    )
    return tuple(None if x is None else to_all(x) for x in blocks)


def to_owners(
    pieces: Sequence[jax.Array | None], layout: Layout, axis_name: str, dtypes: Sequence[Any]
) -> tuple[jax.Array | None, ...]:
    """Stage 3: per bucket with owned leaves, what each device holds of the units this
    device owns (``(num_shards, owned_chunk)``, row ``d`` from device ``d``), from this
    device's 1-D ``pieces`` of every owned leaf, in ``dtypes[b]`` for bucket ``b``
    (``None``: the bucket's stay where they are)."""
    blocks = layout.per_owned_bucket(
        lambda b, _: None if dtypes[b] is None else layout.owned_blocks(pieces, b, dtypes[b], True)
    )
    return exchange(blocks, axis_name)


def piece_blocks(
    layout: Layout, local: Sequence[Any], device: int, bucket: int, dtype: Any
) -> jax.Array:
    """``device``'s units (``local[i]``, as :meth:`zeroshard.core.layout.Slot.local` gives
    them) -> every
    device's pieces of them: ``(num_shards, owned_chunk)``, row ``d`` for device ``d``."""
    parts = []
    for i in (i for i in layout.buckets[bucket].slots if device in layout.slots[i].owners):
        s = layout.slots[i]
        units = list(local[i]) if s.layered else [local[i]]
        parts += [s.unit_geometry().blocks(u.astype(dtype)) for u in units]
    return pack(parts, dtype, layout.buckets[bucket].owned_chunk, lead=(layout.num_shards,))


def piece_from_owners(layout: Layout, received: jax.Array, i: int) -> jax.Array:
    """This device's 1-D piece of owned leaf ``i`` from what the owners sent it
    (``received``: ``(num_shards, owned_chunk)``, row ``d`` from device ``d``): each
    unit's piece from its owner's row."""
    s = layout.slots[i]
    units = [
        received[d, o : o + s.unit_piece] for d, o in zip(s.owners, s.chunk_offsets, strict=True)
    ]
    return jnp.concatenate(units)
