"""Flax integration: zeroshard steps for NNX models and Linen ``TrainState``s.

The optimizer from :func:`zeroshard.sharded` is an ordinary optax transformation, so
it is the ``tx`` of ``flax.nnx.Optimizer`` and of
``flax.training.train_state.TrainState``. What these helpers add is the placement
and the step: parameters replicated in the compute dtype, optimizer state and master
weights sharded over the data axis, and a jitted ``shard_map`` step whose
``out_specs`` keep the parameters replicated (they never drift to the optimizer
state's sharding, as they do under plain ``jax.jit`` with sharding annotations).

NNX::

    model = MyModel(rngs=nnx.Rngs(0))
    optimizer = zs.flax.nnx_optimizer(model, zs.sharded(optax.adamw(1e-3)), mesh)
    train_step = zs.flax.nnx_train_step(loss_fn, mesh)      # loss_fn(model, batch)
    metrics = train_step(model, optimizer, batch)            # updates both in place

Linen::

    state = zs.flax.linen_train_state(model.apply, params, tx, mesh)
    train_step = zs.flax.linen_train_step(loss_fn, tx, mesh)  # loss_fn(params, batch)
    state, metrics = train_step(state, batch)

Stage 3 (weights as 1/N pieces, gathered layer by layer) works on the functional
:class:`zeroshard.TrainState` from ``zs.init_train_state(params, tx, mesh, stage=3)``;
these helpers make Flax layers gather their own weights:

- Linen: call a layer as ``zs.flax.linen_layer(nn.Dense(256))(params["Dense_0"], x)``;
- NNX: call a layer as ``zs.flax.nnx_layer(model.layer)(params["layer"], x)``;

where the first argument is that layer's ``Shard`` subtree of the state's params.
Each gathers the layer's weights (one all-gather per dtype) and gathers them again
in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.training import train_state as linen_train_state_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.layout import PyTree
from zeroshard.local_update import ShardedTransformation, init_local
from zeroshard.train_step import _check_batch, _check_other_axes, _check_setup, step_metrics


def _check_flax_setup(tx: Any, mesh: jax.sharding.Mesh, axis_name: str) -> None:
    _check_setup(tx, mesh, axis_name)
    for option, value in (("replica_axis", tx.replica_axis), ("loss_scale", tx.loss_scale)):
        if value is not None:
            raise ValueError(
                f"the Flax steps do not support zs.sharded(..., {option}=...); use "
                "zs.make_train_step with the params from nnx.split / the Linen variables."
            )
    _check_other_axes(mesh, (axis_name,))


def _replicated_copy(tree: PyTree, mesh: jax.sharding.Mesh, axis_name: str) -> PyTree:
    """``tree`` replicated on ``mesh``, in fresh buffers laid out as a step returns them."""
    copy = jax.shard_map(
        lambda t: jax.tree.map(jnp.copy, t),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
        axis_names={axis_name},
    )
    return jax.jit(copy)(jax.device_put(tree, NamedSharding(mesh, P())))


# NNX.


def nnx_optimizer(
    model: nnx.Module,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    wrt: Any = nnx.Param,
) -> nnx.Optimizer:
    """Places ``model`` on ``mesh`` (replicated) and builds its sharded ``nnx.Optimizer``.

    Args:
      model: the NNX model; its state is moved onto ``mesh`` in place.
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh.
      axis_name: the data-parallel axis.
      wrt: which variables the optimizer updates.

    Returns:
      ``nnx.Optimizer(model, tx, wrt=wrt)`` with its state 1/N per device.
    """
    _check_flax_setup(tx, mesh, axis_name)
    nnx.update(model, _replicated_copy(nnx.state(model), mesh, axis_name))
    with jax.set_mesh(mesh):
        return nnx.Optimizer(model, tx, wrt=wrt)


def _spec(x: Any) -> P:
    sharding = getattr(x, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


class NNXTrainStep:
    """``metrics = train_step(model, optimizer, batch)``; see :func:`nnx_train_step`."""

    def __init__(self, loss_fn, mesh, axis_name: str, has_aux: bool, donate: bool):
        self.loss_fn, self.mesh, self.axis_name, self.has_aux = loss_fn, mesh, axis_name, has_aux
        self.num_shards = mesh.shape[axis_name]
        self._donate = donate
        self._compiled: dict[Any, Callable] = {}

    def _build(self, graphdef: Any, specs: PyTree) -> Callable:
        axis = self.axis_name

        def local(state: PyTree, batch: PyTree) -> tuple[PyTree, dict]:
            model, optimizer = nnx.merge(graphdef, state)
            model_def, params, rest = nnx.split(model, optimizer.wrt, ...)

            def loss_of(p: PyTree) -> Any:
                return self.loss_fn(nnx.merge(model_def, p, rest), batch)

            local_params = jax.lax.pcast(params, axis, to="varying")
            out, grads = jax.value_and_grad(loss_of, has_aux=self.has_aux)(local_params)
            loss, aux = out if self.has_aux else (out, None)
            optimizer.update(model, grads)
            grad_norm = nnx.as_pure(optimizer.opt_state).grad_norm
            return nnx.state((model, optimizer)), step_metrics(loss, aux, grad_norm, axis)

        step = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(specs, P(axis)),
            out_specs=(specs, P()),
            axis_names={axis},
        )
        return jax.jit(step, donate_argnums=(0,) if self._donate else ())

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> dict:
        _check_batch(batch, self.num_shards, self.axis_name)
        graphdef, state = nnx.split((model, optimizer))
        specs = jax.tree.map(_spec, state)
        key = (graphdef, jax.tree.structure(state), tuple(jax.tree.leaves(specs)))
        if key not in self._compiled:
            self._compiled[key] = self._build(graphdef, specs)
        batch = jax.device_put(batch, NamedSharding(self.mesh, P(self.axis_name)))
        state, metrics = self._compiled[key](state, batch)
        nnx.update((model, optimizer), state)
        return metrics


def nnx_train_step(
    loss_fn: Callable[[nnx.Module, PyTree], Any],
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    has_aux: bool = False,
    donate: bool = True,
) -> NNXTrainStep:
    """A jitted ZeRO-1 step for an NNX model and its :func:`nnx_optimizer`.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar`` (or ``(scalar, aux)``), the mean
        loss over the batch it is given.
      mesh: the device mesh.
      axis_name: the axis the batch's leading dimension is split over.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the model's and optimizer's buffers to their updated values.

    Returns:
      ``train_step(model, optimizer, batch) -> metrics`` (global mean ``"loss"`` and
      ``"grad_norm"``), updating ``model`` and ``optimizer`` in place.
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r} (its axes: {mesh.axis_names}).")
    return NNXTrainStep(loss_fn, mesh, axis_name, has_aux, donate)


# Linen (flax.training.train_state.TrainState).


def linen_train_state(
    apply_fn: Callable[..., Any],
    params: PyTree,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    param_dtype: Any = None,
) -> linen_train_state_lib.TrainState:
    """``flax.training.train_state.TrainState.create`` for a sharded optimizer.

    Args:
      apply_fn: the Linen model's ``apply``.
      params: the initial parameters; the master weights start from them as given.
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh.
      axis_name: the data-parallel axis.
      param_dtype: compute dtype of the replicated parameters (``None``: as given).

    Returns:
      A Flax ``TrainState``: params replicated, ``opt_state`` 1/N per device.
    """
    _check_flax_setup(tx, mesh, axis_name)

    def local(master: PyTree) -> linen_train_state_lib.TrainState:
        cast = lambda x: jnp.array(x, dtype=param_dtype or x.dtype, copy=True)
        params = jax.tree.map(cast, master)
        return linen_train_state_lib.TrainState(
            step=jnp.zeros((), jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=init_local(tx, params, master),
        )

    compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype or x.dtype), params)
    specs = _linen_specs(tx, apply_fn, compute, mesh.shape[axis_name])
    init = jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=specs, axis_names={axis_name})
    return jax.jit(init)(jax.device_put(params, NamedSharding(mesh, P())))


def _linen_specs(tx, apply_fn, params, num_shards) -> linen_train_state_lib.TrainState:
    return linen_train_state_lib.TrainState(
        step=P(), apply_fn=apply_fn, params=P(), tx=tx, opt_state=tx.state_specs(params, num_shards)
    )


def linen_train_step(
    loss_fn: Callable[[PyTree, PyTree], Any],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    has_aux: bool = False,
    donate: bool = True,
) -> Callable[..., tuple[linen_train_state_lib.TrainState, dict]]:
    """A jitted ZeRO-1 step for a Flax ``TrainState`` from :func:`linen_train_state`.

    Each device differentiates ``loss_fn`` on its share of the batch; then
    ``state.apply_gradients`` runs the sharded optimizer (reduce-scatter, update of
    this device's slice, all-gather).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (or ``(scalar, aux)``).
      tx: the state's optimizer, from :func:`zeroshard.sharded`.
      mesh: the device mesh.
      axis_name: the axis the batch's leading dimension is split over.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the input state's buffers.

    Returns:
      ``train_step(state, batch) -> (state, metrics)``.
    """
    _check_flax_setup(tx, mesh, axis_name)
    num_shards = mesh.shape[axis_name]

    def local(state, batch):
        local_params = jax.lax.pcast(state.params, axis_name, to="varying")
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(local_params, batch)
        loss, aux = out if has_aux else (out, None)
        state = state.apply_gradients(grads=grads)
        return state, step_metrics(loss, aux, state.opt_state.grad_norm, axis_name)

    def global_step(state, batch):
        _check_batch(batch, num_shards, axis_name)
        specs = _linen_specs(tx, state.apply_fn, state.params, num_shards)
        step = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, P(axis_name)),
            out_specs=(specs, P()),
            axis_names={axis_name},
        )
        return step(state, batch)

    jitted = jax.jit(global_step, donate_argnums=(0,) if donate else ())
    batch_sharding = NamedSharding(mesh, P(axis_name))

    def train_step(state, batch):
        _check_batch(batch, num_shards, axis_name)
        return jitted(state, jax.device_put(batch, batch_sharding))

    train_step.jitted = jitted
    return train_step


# Stage 3: per-layer gathering.


def linen_layer(module: Any, axis_name: str = "data") -> Callable[..., Any]:
    """``fn(layer_params, *args)``: applies a Linen module to gathered weights (stage 3).

    Args:
      module: an (unbound) Linen module, e.g. ``nn.Dense(256)``.
      axis_name: the axis the pieces are spread over.

    Returns:
      ``module.apply({"params": gather(layer_params)}, *args)`` as a function of the
      module's ``Shard`` parameters and the call's arguments, with the weights gathered
      again in the backward pass (:func:`zeroshard.layer`).
    """
    from zeroshard.gather import layer

    return layer(lambda params, *args: module.apply({"params": params}, *args), axis_name)


def nnx_layer(module: nnx.Module, axis_name: str = "data") -> Callable[..., Any]:
    """``fn(layer_params, *args)``: runs an NNX module on gathered weights (stage 3).

    Args:
      module: the NNX module (its own parameter values are not used: only its
        structure and non-parameter state).
      axis_name: the axis the pieces are spread over.

    Returns:
      A function of the module's ``Shard`` parameters (the pure-dict subtree, as in
      ``nnx.to_pure_dict(nnx.state(module, nnx.Param))``) and the call's arguments. It
      gathers the weights with one all-gather per dtype and recomputes them in the
      backward pass (:func:`zeroshard.layer`).
    """
    from zeroshard.gather import layer

    graphdef, _, rest = nnx.split(module, nnx.Param, ...)

    def apply(params: PyTree, *args: Any) -> Any:
        return nnx.merge(graphdef, nnx.State(params), rest)(*args)

    return layer(apply, axis_name)
