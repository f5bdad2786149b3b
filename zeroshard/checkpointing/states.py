"""The training states the orbax handler saves, each seen as one form: a
:class:`zeroshard.TrainState` on its mesh, plus ``extra`` leaves stored as they are.

- a :class:`zeroshard.TrainState` (from :func:`zeroshard.init_train_state` or a train
  step): itself;
- a Flax Linen ``TrainState`` (``flax.training.train_state.TrainState`` or a subclass)
  created with ``tx=zs.sharded(...)``: its ``step``, ``params`` (whole, replicated)
  and ``opt_state`` (a :class:`zeroshard.ShardedState`); every other pytree field (an
  EMA of the weights, batch statistics, ...) is ``extra``;
- a Flax NNX ``(model, optimizer)`` pair, ``optimizer = nnx.Optimizer(model,
  zs.sharded(...), wrt=...)``: the model's ``wrt`` variables are the parameters, the
  optimizer's state and step the rest; the model's other variables (batch
  statistics, RNG state, ...) are ``extra``.

:func:`parts_of` takes a state apart; :func:`rebuilt` puts restored parts into a target
of the same kind (an NNX pair is updated in place, as ``nnx.update`` does). Typed PRNG
keys among the extra leaves are stored as their key data and wrapped again on restore.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import find_mesh, mesh_of, sharding_of
from zeroshard.optimizer.sharded import ShardedTransformation, optimizer_of
from zeroshard.optimizer.state import ShardedState, key_of
from zeroshard.training.step import TrainState

KINDS = (
    "a zs.TrainState, a Flax Linen TrainState created with tx=zs.sharded(...), or an NNX "
    "(model, optimizer) pair with optimizer = nnx.Optimizer(model, zs.sharded(...), wrt=...)"
)
_LINEN_CORE = ("step", "params", "opt_state")


class Parts(NamedTuple):
    """A training state as the handler stores it.

    Attributes:
      state: the :class:`zeroshard.TrainState` (step replicated on the mesh).
      extra: the other leaves by name (``{}`` when there are none), as stored.
      tx: the optimizer from :func:`zeroshard.sharded` the state belongs to.
    """

    state: TrainState
    extra: dict[str, PyTree]
    tx: ShardedTransformation


def _nnx_optimizer(x: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional
        return False
    return isinstance(x, nnx.Optimizer)


def kind_of(state: Any) -> str:
    """``"zeroshard"``, ``"linen"`` or ``"nnx"``.

    Raises:
      TypeError: for any other object, naming the kinds accepted.
    """
    if isinstance(state, TrainState):
        return "zeroshard"
    if isinstance(state, (tuple, list)) and len(state) == 2 and _nnx_optimizer(state[1]):
        return "nnx"
    names = {f.name for f in dataclasses.fields(state)} if dataclasses.is_dataclass(state) else ()
    if all(name in names for name in _LINEN_CORE):
        return "linen"
    raise TypeError(f"zeroshard saves and restores {KINDS}; got a {type(state).__name__}.")


def _split(state: Any, tx: ShardedTransformation | None) -> tuple[str, Parts]:
    """``state``'s kind and its parts as they are: its step, params and opt_state as a
    :class:`zeroshard.TrainState`; the other leaves by name (a Linen state's other
    pytree fields that hold arrays, an NNX model's variables outside ``wrt`` as
    ``"model"``); and ``tx``, else the optimizer the state carries (a Linen state's
    ``tx``, an NNX optimizer's ``tx``), which must be from :func:`zeroshard.sharded`."""
    kind = kind_of(state)
    if kind == "zeroshard":
        if tx is None:
            raise ValueError(
                "a zs.TrainState does not carry its optimizer: pass tx, the zs.sharded(...) "
                "it was made with."
            )
        core, extra = state, {}
    elif kind == "linen":
        tx = state.tx if tx is None else tx
        core = TrainState(state.step, state.params, state.opt_state)
        fields = [f.name for f in dataclasses.fields(state) if f.metadata.get("pytree_node", True)]
        extra = {name: getattr(state, name) for name in fields if name not in _LINEN_CORE}
        extra = {name: value for name, value in extra.items() if _has_leaves(value)}
    else:
        from flax import nnx

        model, optimizer = state
        tx = optimizer.tx if tx is None else tx
        params = nnx.as_pure(nnx.state(model, optimizer.wrt))
        others = nnx.as_pure(nnx.state(model, nnx.Not(optimizer.wrt)))
        core = TrainState(optimizer.step[...], params, nnx.as_pure(optimizer.opt_state))
        extra = {"model": others} if _has_leaves(others) else {}
    optimizer_of(tx)  # a TypeError with the fix for a plain optax optimizer
    return kind, Parts(core, extra, tx)


def _has_leaves(tree: PyTree) -> bool:
    return bool(jax.tree.leaves(tree))


def parts_of(state: Any, tx: ShardedTransformation | None = None) -> Parts:
    """``state`` (any of the kinds above) taken apart, the step on the state's mesh and
    the extra leaves as stored.

    Raises:
      TypeError: for another kind of state, or a state without a
        :class:`zeroshard.ShardedState`.
    """
    kind, (core, extra, tx) = _split(state, tx)
    if kind == "zeroshard":
        mesh_of(state)  # a TypeError unless it is laid out on a mesh
        # (the axes it carries: on a mesh with other axes, split over those too)
        return Parts(state, {}, tx.over(key_of(state.opt_state).axes))
    if not isinstance(core.opt_state, ShardedState):
        owner = "the TrainState" if kind == "linen" else "the optimizer"
        raise TypeError(
            f"{owner}'s opt_state is a {type(core.opt_state).__name__}, not a "
            "zs.ShardedState: build the state with the optimizer from zs.sharded(...), "
            "e.g. tx=zs.sharded(optax.adamw(1e-3), mesh=mesh)."
        )
    mesh = find_mesh(tx.config, core.opt_state, context=False, any_axes=True)
    step = jax.device_put(jnp.asarray(core.step, jnp.int32), NamedSharding(mesh, P()))
    # (the one-line drop-in's state is split over every axis of its mesh)
    return Parts(core._replace(step=step), stored(extra), tx.over(key_of(core.opt_state).axes))


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def stored(tree: PyTree) -> PyTree:
    """``tree`` as the handler writes it: typed PRNG keys as their key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def target_parts(
    target: Any, tx: ShardedTransformation | None, mesh: jax.sharding.Mesh | None
) -> tuple[Parts, jax.sharding.Mesh, int]:
    """What a restore reads into: the target's parts (the extra leaves as
    ``ShapeDtypeStruct``, placed where the target has them, else replicated), its mesh
    and its stage (3 where its state says its params are ``Piece`` pieces).

    Args:
      target: a state of the kind to restore (arrays or ``jax.ShapeDtypeStruct``).
      tx: the optimizer (default: the one the target carries).
      mesh: the mesh to restore onto (default: the optimizer's, else the target's).
    """
    kind, (core, extra, tx) = _split(target, tx)
    if kind == "zeroshard":
        mesh = find_mesh(tx.config, (core.step, core.opt_state), mesh, context=False)
    else:  # the one-line drop-in's state, split over every axis of its mesh
        mesh = find_mesh(tx.config, core.opt_state, mesh, context=False, any_axes=True)
        tx = tx.spanning(mesh)
    return Parts(core, _structs(extra, mesh), tx), mesh, 3 if key_of(core.opt_state).pieces else 1


def _structs(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """``ShapeDtypeStruct`` of the stored form of ``tree``'s leaves on ``mesh``."""
    devices = set(mesh.devices.flat)

    def struct(x: Any) -> jax.ShapeDtypeStruct:
        sharding = sharding_of(x)
        keep = isinstance(sharding, NamedSharding) and set(sharding.device_set) == devices
        shape = jax.eval_shape(lambda y: stored(y), x)
        if not keep or _is_key(x):
            sharding = NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

    return jax.tree.map(struct, tree)


def _loaded(read: PyTree, like: PyTree) -> PyTree:
    """Extra leaves read back, typed PRNG keys wrapped again as ``like``'s."""
    return jax.tree.map(
        lambda r, x: jax.random.wrap_key_data(r, impl=jax.random.key_impl(x)) if _is_key(x) else r,
        read,
        like,
    )


def rebuilt(target: Any, state: TrainState, extra: dict[str, PyTree]) -> Any:
    """The restored ``state`` and ``extra`` in ``target``'s kind (an NNX pair is updated
    in place and returned)."""
    kind = kind_of(target)
    if kind == "zeroshard":
        return state
    if kind == "linen":
        step = state.step
        if isinstance(target.step, int):
            step = int(step)
        elif hasattr(target.step, "dtype"):
            step = step.astype(target.step.dtype)
        fields = {k: _loaded(v, getattr(target, k)) for k, v in extra.items()}
        return target.replace(step=step, params=state.params, opt_state=state.opt_state, **fields)
    from flax import nnx

    model, optimizer = target
    if "model" in extra:
        rest = nnx.as_pure(nnx.state(model, nnx.Not(optimizer.wrt)))
        nnx.update(model, _loaded(extra["model"], rest))
    nnx.update(model, state.params)
    nnx.update(optimizer.opt_state, nnx.state(state.opt_state))
    optimizer.step[...] = state.step.astype(optimizer.step[...].dtype)
    return target
