"""State: :class:`ShardedState`, what :func:`zeroshard.sharded` keeps per device, and
:class:`TrainState`, what one training step reads and writes."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import optax

from zeroshard.core.layout import Layout, PyTree, Split
from zeroshard.optimizer.loss_scale import LossScaleState


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LayoutKey:
    """How a :class:`ShardedState` is laid out, which it carries as its static part
    (pytree aux data: ``jax.jit`` compares it, and nothing reads it again from the
    arrays' shardings). With the optimizer, the mesh and the parameters' shapes it
    gives the state's :class:`zeroshard.core.state_layout.StateLayout` again.

    A static pytree node, not a ``NamedTuple``: no tree walk finds a leaf in it, so
    tools that walk the state's ``NamedTuple`` fields (``optax.tree_utils.tree_set``)
    rebuild it with jax's own structure.

    Attributes:
      axes: the mesh axes the state is split over.
      splits: the leaves it keeps block by block over the mesh's other axes, as
        ``(index, *fields of its split)`` (:class:`zeroshard.core.layout.Split`): plain
        data, so that pickle and Flax's msgpack serialization take it.
      pieces: whether the weights beside it are :class:`zeroshard.Piece` pieces
        (zeroshard's step at stage 3, the stage of its optimizer's config): what a
        reader of the state (``zs.to_optax_state``, a checkpoint) asks, not the weights.
    """

    axes: tuple[str, ...]
    splits: tuple[tuple, ...] = ()
    pieces: bool = False

    @classmethod
    def of(cls, axes: tuple[str, ...], layout: Layout, pieces: bool = False) -> LayoutKey:
        """The key of a state split over ``axes`` as ``layout`` lays it out, beside
        weights held as pieces or not."""
        splits = tuple((i, *dataclasses.astuple(x)) for i, x in layout.splits.items())
        return cls(tuple(axes), splits, pieces)

    @property
    def by_leaf(self) -> dict[int, Split]:
        """The :class:`zeroshard.core.layout.Split` of each leaf kept block by block."""
        return {i: Split(*fields) for i, *fields in self.splits}


try:  # flax is optional; its msgpack (flax.serialization.to_bytes) writes the key's fields
    from flax import serialization
except ImportError:
    serialization = None
if serialization is not None:
    _FIELDS = ("axes", "splits", "pieces")  # (a field missing in older bytes: the target's)
    serialization.register_serialization_state(
        LayoutKey,
        lambda key: {f: serialization.to_state_dict(getattr(key, f)) for f in _FIELDS},
        lambda key, saved: LayoutKey(
            *(
                serialization.from_state_dict(getattr(key, f), saved.get(f, getattr(key, f)), f)
                for f in _FIELDS
            )
        ),
    )


class ShardedState(NamedTuple):
    """State of :func:`sharded`; every array is this device's part or a scalar.

    Attributes:
      inner_state: the inner optimizer's state for this device's pieces. Not plain
        optax's layout: a leaf's moments are ``None`` where the leaf is owned (they
        are in ``owned``) and where it is updated in a group of alike small leaves
        (they are laid end to end in the group's first leaf's place), and a sliced
        leaf's are its piece, flattened. ``zs.to_optax_state`` gives every leaf's
        state as ``inner.init(params)`` shapes it
        (``zs.to_optax_state(state, tx)[1][0].mu["w"]``).
      master: this device's pieces of the master weights: a tree like the parameters,
        shaped like the inner state's pieces, with ``None`` at leaves already in the
        master dtype (their piece is the master) and at owned leaves (their master is
        in ``owned``); ``None`` when no leaf keeps a master.
      grad_norm: global L2 norm of the mean gradient at the last update, before any
        clipping (``nan`` or ``inf`` when that gradient was not finite).
      skipped: number of updates skipped because the mean gradient was not finite
        (int32; see ``skip_nonfinite`` in :func:`sharded`). A step of
        :func:`zeroshard.make_train_step` reports whether it was skipped as
        ``metrics["skipped"]`` (0 or 1).
      loss_scale: the dynamic loss scale's state, or ``None`` without loss scaling.
        A step of :func:`zeroshard.make_train_step` reports the scale it used as
        ``metrics["loss_scale"]``.
      owned: per dtype, this device's row of the inner state and master weights of
        the leaves it owns (see :class:`zeroshard.core.placement.Storage`); ``()`` when no
        leaf is owned.
      layout: how the state is laid out (:class:`LayoutKey`), static: not a leaf
        (``jax.tree.leaves`` does not list it), and equal across steps. ``None`` on a
        state built by hand, which zeroshard refuses.
    """

    inner_state: optax.OptState
    master: PyTree
    grad_norm: jax.Array
    skipped: jax.Array
    loss_scale: LossScaleState | None = None
    owned: tuple[jax.Array, ...] = ()
    layout: LayoutKey | None = None


def key_of(state: ShardedState) -> LayoutKey:
    """The layout ``state`` carries (:attr:`ShardedState.layout`).

    Raises:
      ValueError: if it carries none.
    """
    if state.layout is None:
        raise ValueError(
            "zeroshard: this ShardedState carries no layout (ShardedState.layout is None: "
            "built by hand, or unpickled from an older zeroshard). Make it with tx.init, "
            "zs.init_train_state or zs.from_optax_state."
        )
    return state.layout


_ARRAYS = ShardedState._fields[:-1]
jax.tree_util.register_pytree_with_keys(
    ShardedState,
    lambda s: ([(jax.tree_util.GetAttrKey(k), getattr(s, k)) for k in _ARRAYS], s.layout),
    lambda layout, arrays: ShardedState(*arrays, layout),
    flatten_func=lambda s: (s[:-1], s.layout),
)


class TrainState(NamedTuple):
    """What one training step reads and writes.

    Attributes:
      step: number of steps taken (int32 scalar, replicated).
      params: the parameters in the compute dtype: full and replicated over the
        batch axes (stages 1 and 2; over the mesh's other axes, e.g. tensor
        parallelism's ``"model"``, in their own layout), or a tree of
        :class:`zeroshard.Piece` pieces (stage 3).
      opt_state: the :class:`ShardedState`: optimizer state and master weights, 1/N
        per device.
      model_state: non-trainable model state (e.g. ``{"batch_stats": ...}`` of a Linen
        BatchNorm), replicated and averaged over the batch axes each step; ``None``
        when the model has none.
    """

    step: jax.Array
    params: PyTree
    opt_state: ShardedState
    model_state: PyTree = None
