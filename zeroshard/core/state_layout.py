"""State layout: where one optimizer's state lies, worked out once per entry point.

A :class:`StateLayout` is built once per optimizer, mesh and layout of the
parameters over the mesh, and carried: :func:`zeroshard.init_train_state`,
:func:`zeroshard.make_train_step` (once per layout of the weights it is called
with), :func:`zeroshard.to_optax_state` / :func:`zeroshard.from_optax_state`, the
checkpoints, :func:`zeroshard.step_memory` / :func:`zeroshard.estimate_memory` and
the Flax adapters each build one here and read everything from it. It holds the
optimizer over the state's axes (the batch's, and the mesh's others but the
replica axis: :meth:`zeroshard.optimizer.sharded.Sharded.for_step`) and its plan, whose
record of each leaf is its logical shape and dtype, its geometry over those axes
(a tensor-parallel leaf's block, cut over the batch axes, folded in:
:class:`zeroshard.core.layout.Split`), its placement, its state leaves with their kinds,
dtypes and low-bit coding, its master dtype and its group
(:class:`zeroshard.core.placement.Plan`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import mesh_size
from zeroshard.communication.stage3 import full_structs, layout_of
from zeroshard.core.layout import WHOLE, Layout, PyTree
from zeroshard.core.mesh import keep_axes, mesh_of
from zeroshard.core.placement import Plan
from zeroshard.optimizer.sharded import ShardedTransformation, check_made, optimizer_of
from zeroshard.optimizer.state import TrainState, key_of


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How one optimizer's state lies on a mesh, for one layout of the parameters.

    Attributes:
      tx: the optimizer over the state's axes.
      plan: every leaf's record (see the module's description).
      weights: the parameters' own layout over the state's axes besides the batch's,
        a ``PartitionSpec`` per leaf (tensor parallelism's ``P(None, "model")``,
        say), which the steps keep; a tuple, in leaf order.
      splits: the leaves split over those axes the plan was made for
        (:meth:`zeroshard.optimizer.sharded.Sharded.splits`: the weights' layout says so; the
        plan keeps those it can cut block by block), as ``(index, split)`` pairs.
    """

    tx: ShardedTransformation
    plan: Plan = dataclasses.field(compare=False, hash=False)
    weights: tuple[P, ...]
    layout: Layout
    splits: tuple = ()

    @property
    def num_shards(self) -> int:
        """The devices the state is split over."""
        return self.layout.num_shards

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        """The state's axes, as one ``axis_name``."""
        return self.tx.axis_name

    @property
    def weight_specs(self) -> PyTree:
        """:attr:`weights` as a tree like the parameters."""
        return self.layout.treedef.unflatten(self.weights)

    def returned(self, departure: Any) -> TrainState:
        """:meth:`specs`, the weights (but stage 3's pieces) in their own layout
        (:attr:`weights`): the state as a step returns it."""
        specs = self.specs(departure)
        return specs if departure.pieces else specs._replace(params=self.weight_specs)

    def specs(self, departure: Any) -> TrainState:
        """``PartitionSpec`` of every leaf of a global :class:`zeroshard.TrainState`
        whose weights are held as ``departure`` holds them
        (:attr:`zeroshard.core.update.Route.departure`)."""
        opt_state = self.tx.optimizer.specs_of(self.plan, departure.pieces)
        return TrainState(P(), departure.param_specs(self.layout, self.axis_name), opt_state, P())


def state_layout(
    tx: ShardedTransformation, mesh: Any, params: PyTree, weights: PyTree = None
) -> StateLayout:
    """The layout of zeroshard's step's state on ``mesh`` for ``params`` (arrays,
    ``ShapeDtypeStruct`` or stage-3 pieces, in the compute dtypes), their own layout
    over the mesh's axes besides the batch's being ``weights`` (a ``PartitionSpec``
    per leaf; default: read from ``params``, :func:`zeroshard.communication.stage3.layout_of`)."""
    state_tx, rest = step_axes(tx, mesh)
    weights = layout_of(params, rest) if weights is None else keep_axes(weights, rest)
    splits = optimizer_of(tx).splits(mesh, weights)
    return _built(state_tx, mesh_size(mesh, state_tx.axis_name), params, weights, splits)


def drop_in_is_step(tx: ShardedTransformation, mesh: Any) -> bool:
    """Whether the one-line drop-in lays ``tx``'s state out on ``mesh`` over the axes,
    in the order, zeroshard's step does."""
    opt = optimizer_of(tx)
    return opt.spanning(mesh).config.axes == opt.for_step(mesh).config.axes


def step_axes(
    tx: ShardedTransformation, mesh: Any
) -> tuple[ShardedTransformation, tuple[str, ...]]:
    """``tx`` as zeroshard's step on ``mesh`` lays its state out (over the batch axes
    and the mesh's others but the replica axis), and those others."""
    return tx.for_step(mesh), optimizer_of(tx).other_axes(mesh)


def state_devices_on(tx: ShardedTransformation, mesh: Any) -> int:
    """The devices of ``mesh`` zeroshard's step splits ``tx``'s state over."""
    return mesh_size(mesh, step_axes(tx, mesh)[0].axis_name)


def layout_of_state(tx: ShardedTransformation, state: TrainState) -> StateLayout:
    """The layout a global ``state`` was made with, on its mesh: the one it carries
    (:attr:`zeroshard.ShardedState.layout`: over a step's axes or the one-line
    drop-in's, a tensor-parallel leaf's state block by block where it keeps it so),
    not read from its arrays; its :attr:`StateLayout.weights`, those of the leaves it
    keeps so.

    Raises:
      ValueError: if the state carries no layout, or keeps a leaf block by block
        whose weights are not laid out in those blocks now
        (:func:`zeroshard.optimizer.sharded.check_made`).
    """
    made, mesh, opt = key_of(state.opt_state), mesh_of(state), optimizer_of(tx)
    splits = made.by_leaf
    x = next(iter(splits.values()), WHOLE)  # (over the batch axes of the optimizer that made it)
    weights, n = layout_of(state.params, x.axes), mesh_size(mesh, made.axes)
    built = _built(tx.over(made.axes), n, state.params, weights, splits)
    now = opt.over(x.over).splits(mesh, weights)  # (the weights' blocks now)
    check_made(built.layout, made, made.axes, {i: now[i] for i in splits if i in now})
    return built


def _built(tx, num_shards, params, weights, splits) -> StateLayout:
    structs = jax.tree.flatten(full_structs(params))
    specs = tuple(jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, P)))
    key = (structs[1], tuple(structs[0]), specs, tuple(splits.items()))
    return _cached(tx, num_shards, *key)


@functools.lru_cache(maxsize=256)
def _cached(tx, num_shards, treedef, structs, weights, splits) -> StateLayout:
    plan = tx.plan(treedef.unflatten(structs), num_shards, dict(splits))
    return StateLayout(tx, plan, weights, plan.layout, splits)
