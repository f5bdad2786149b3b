"""Train step: forward and backward on the local batch, then the sharded update.

``init_train_state`` lays the state out on the mesh (parameters replicated in the
compute dtype, optimizer state and master weights sharded); ``make_train_step``
returns a jitted ``shard_map`` step that donates the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.layout import PyTree
from zeroshard.local_update import (
    ShardedState,
    ShardedTransformation,
    apply_update,
    init_local,
)


class TrainState(NamedTuple):
    """What one training step reads and writes.

    Attributes:
      step: number of steps taken (int32 scalar, replicated).
      params: the full parameters in the compute dtype, replicated on every device.
      opt_state: the :class:`ShardedState`: optimizer state and master weights, 1/N
        per device.
    """

    step: jax.Array
    params: PyTree
    opt_state: ShardedState


def _check_setup(tx: Any, mesh: jax.sharding.Mesh, axis_name: str) -> None:
    if not isinstance(tx, ShardedTransformation):
        raise TypeError(
            f"expected the optimizer returned by zs.sharded(...), got {type(tx).__name__}: "
            f"wrap it, e.g. zs.sharded(optax.adamw(3e-4), axis_name={axis_name!r})."
        )
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"mesh has no axis {axis_name!r} (its axes: {tuple(mesh.axis_names)}); pass "
            f"axis_name= one of them, or build the mesh with jax.make_mesh((n,), "
            f"({axis_name!r},))."
        )
    if tx.axis_name != axis_name:
        raise ValueError(
            f"the optimizer was built with axis_name={tx.axis_name!r} but the step uses "
            f"axis_name={axis_name!r}; use the same axis for both."
        )


def init_train_state(
    params: PyTree,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    param_dtype: Any = None,
) -> TrainState:
    """Lays a training state out on ``mesh``.

    The master weights start from ``params`` as given (full precision), and the
    replicated compute copy is ``params`` cast to ``param_dtype``.

    Args:
      params: the initial parameters (any placement).
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh; ``axis_name`` must be one of its axes.
      axis_name: the data-parallel axis.
      param_dtype: compute dtype of the replicated parameters (e.g. ``jnp.bfloat16``);
        ``None`` keeps the given dtypes.

    Returns:
      A :class:`TrainState` at step 0.

    Raises:
      TypeError: if ``tx`` is not from :func:`zeroshard.sharded`.
      ValueError: if ``mesh`` has no ``axis_name`` or it differs from the optimizer's.
    """
    _check_setup(tx, mesh, axis_name)

    def local_init(master_params: PyTree) -> TrainState:
        cast = lambda x: jnp.array(x, dtype=param_dtype or x.dtype, copy=True)
        params = jax.tree.map(cast, master_params)
        opt_state = init_local(tx, params, master_params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state)

    params = jax.device_put(params, NamedSharding(mesh, P()))
    compute = jax.eval_shape(
        lambda p: jax.tree.map(lambda x: x.astype(param_dtype or x.dtype), p), params
    )
    specs = TrainState(P(), P(), tx.state_specs(compute, mesh.shape[axis_name]))
    # The same out_specs as the step's, so the first step sees the shardings it returns.
    init = jax.shard_map(
        local_init, mesh=mesh, in_specs=P(), out_specs=specs, axis_names={axis_name}
    )
    return jax.jit(init)(params)


def _check_batch(batch: PyTree, num_shards: int, axis_name: str) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("the batch is empty: pass a pytree of arrays with a batch dimension.")
    for path, x in leaves:
        shape = jnp.shape(x)
        if not shape or shape[0] % num_shards:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}: its leading "
                f"(global batch) dimension must be divisible by the {num_shards} devices of "
                f"axis {axis_name!r}. Use a global batch size that is a multiple of "
                f"{num_shards}."
            )


class TrainStep:
    """A jitted data-parallel training step; see :func:`make_train_step`.

    Call it as ``state, metrics = train_step(state, batch)``; ``lower(state, batch)``
    gives the ``jax.stages.Lowered`` program (for HLO inspection) and ``jitted`` the
    underlying ``jax.jit`` function.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        tx: ShardedTransformation,
        mesh: jax.sharding.Mesh,
        axis_name: str,
        has_aux: bool,
        donate: bool,
    ):
        self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
        self.axis_name, self.has_aux = axis_name, has_aux
        self.num_shards = mesh.shape[axis_name]
        self._batch_sharding = NamedSharding(mesh, P(axis_name))
        self.jitted = jax.jit(self._global_step, donate_argnums=(0,) if donate else ())

    def _local_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        axis = self.axis_name
        # Differentiate w.r.t. a varying copy: the gradient of a replicated input
        # would be all-reduced automatically (DESIGN.md, pitfall 1).
        local_params = jax.lax.pcast(state.params, axis, to="varying")
        out, grads = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(local_params, batch)
        loss, aux = out if self.has_aux else (out, None)
        params, opt_state = apply_update(self.tx, grads, state.opt_state, state.params)
        metrics = {
            "loss": jax.lax.pmean(loss.astype(jnp.float32), axis),
            "grad_norm": opt_state.grad_norm,
        }
        if self.has_aux:
            metrics["aux"] = jax.lax.pmean(aux, axis)
        return TrainState(state.step + 1, params, opt_state), metrics

    def _global_step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        _check_batch(batch, self.num_shards, self.axis_name)
        specs = TrainState(P(), P(), self.tx.state_specs(state.params, self.num_shards))
        batch_specs = jax.tree.map(lambda _: P(self.axis_name), batch)
        step = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(specs, batch_specs),
            out_specs=(specs, P()),
            axis_names={self.axis_name},
        )
        return step(state, batch)

    def _place(self, batch: PyTree) -> PyTree:
        _check_batch(batch, self.num_shards, self.axis_name)
        return jax.device_put(batch, self._batch_sharding)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        return self.jitted(state, self._place(batch))

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for ``state`` and ``batch`` without running it."""
        return self.jitted.lower(state, self._place(batch))


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    has_aux: bool = False,
    donate: bool = True,
) -> TrainStep:
    """Builds a jitted ZeRO-1 training step.

    Each device computes the loss and gradients of ``loss_fn`` on its share of the
    batch, then the sharded optimizer reduce-scatters the gradients, updates its
    slice and all-gathers the new weights.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (or ``(scalar, aux)`` with
        ``has_aux``): the mean loss over the batch it is given.
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh.
      axis_name: the axis the batch's leading dimension is split over.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged over
        devices into ``metrics["aux"]``.
      donate: donate the input state's buffers to the output state.

    Returns:
      A :class:`TrainStep`: ``state, metrics = train_step(state, batch)``, where
      ``metrics`` has the global mean ``"loss"`` and ``"grad_norm"`` (the global norm
      of the mean gradient, before clipping).

    Raises:
      TypeError: if ``tx`` is not from :func:`zeroshard.sharded`.
      ValueError: if ``mesh`` has no ``axis_name``; at call time, if a batch leaf's
        leading dimension is not divisible by the axis size.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zeroshard as zs
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> tx = zs.sharded(optax.sgd(0.1), axis_name="data")
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> state = zs.init_train_state({"w": jnp.zeros((2, 1))}, tx, mesh)
      >>> train_step = zs.make_train_step(loss_fn, tx, mesh)
      >>> batch = {"x": jnp.ones((8, 2)), "y": jnp.ones((8, 1))}
      >>> state, metrics = train_step(state, batch)
      >>> float(metrics["loss"]), int(state.step)
      (1.0, 1)
    """
    _check_setup(tx, mesh, axis_name)
    return TrainStep(loss_fn, tx, mesh, axis_name, has_aux, donate)
