"""Flax integration: zeroshard steps for NNX models and Linen's ``TrainState``.

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

The model runs as written: dropout draws a distinct stream per device (NNX: the
model's ``nnx.Rngs``; Linen: the step's ``key``), ``BatchNorm`` normalises with
global-batch statistics and its running statistics stay identical on every device,
and aux with a leading batch dimension (logits) comes back as the global array.

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

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state
from flax.training import train_state as linen_train_state_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.checks import check_batch, check_mesh, check_other_axes
from zeroshard.layout import PyTree
from zeroshard.sharded import ShardedTransformation, sharding_of
from zeroshard.stage3 import layer
from zeroshard.step_io import (
    auto_twin,
    call_loss,
    device_key,
    local_rows,
    mean_state,
    plain_outputs,
    stacked_aux,
    step_metrics,
    update_metrics,
)


def _check_flax_setup(tx: Any, mesh: jax.sharding.Mesh, axis_name: str | None) -> str:
    """The data-parallel axis (default: the optimizer's), after checking the setup."""
    config = sharding_of(tx).config
    axis_name = check_mesh(config, mesh, axis_name)
    for option, value in (("replica_axis", config.replica_axis), ("loss_scale", config.loss_scale)):
        if value is not None:
            raise ValueError(
                f"the Flax steps do not support zs.sharded(..., {option}=...); use "
                "zs.make_train_step with the params from nnx.split / the Linen variables."
            )
    return axis_name


def _placed_copy(tree: PyTree, mesh: jax.sharding.Mesh, axis_name: str) -> PyTree:
    """``tree`` on ``mesh`` in fresh buffers: replicated over ``axis_name``, and laid out
    over the mesh's other axes as it already was (the model's sharding annotations)."""

    def spec(x: Any) -> P:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
            return P()
        drop = lambda e: tuple(a for a in e if a != axis_name) or None
        return P(
            *(
                drop(e) if isinstance(e, tuple) else None if e == axis_name else e
                for e in sharding.spec
            )
        )

    shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tree)
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)
    return copy(jax.device_put(tree, shardings))


# NNX.


def nnx_optimizer(
    model: nnx.Module,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    wrt: Any = nnx.Param,
    param_dtype: Any = None,
) -> nnx.Optimizer:
    """Places ``model`` on ``mesh`` and builds its sharded ``nnx.Optimizer``.

    The model's arrays are replicated over ``axis_name`` and keep their layout over
    the mesh's other axes (e.g. ``out_sharding`` / ``nnx.with_partitioning``
    annotations over a ``"model"`` axis, which the step honours). The optimizer state
    holds plain arrays sharded 1/N over ``axis_name`` (replicated over the other
    axes): the parameters' sharding metadata is not copied onto it, so nothing
    re-lays the slices out, as ``nnx.Optimizer`` would.

    Args:
      model: the NNX model; its state is moved onto ``mesh`` in place (and its
        parameters cast to ``param_dtype``).
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh.
      axis_name: the data-parallel axis (default: the optimizer's).
      wrt: which variables the optimizer updates.
      param_dtype: compute dtype of the model's parameters (e.g. ``jnp.bfloat16``);
        the master weights start from their values as given. ``None`` keeps them.

    Returns:
      An ``nnx.Optimizer(model, tx, wrt=wrt)`` with its state 1/N per device.
    """
    axis_name = _check_flax_setup(tx, mesh, axis_name)
    master = nnx.as_pure(nnx.state(model, wrt))
    nnx.update(model, jax.tree.map(lambda x: x.astype(param_dtype or x.dtype), master))
    nnx.update(model, _placed_copy(nnx.state(model), mesh, axis_name))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(nnx.as_pure(nnx.state(model, wrt)), replicated)
    opt_state = tx.sharding.init_global(params, mesh, jax.device_put(master, replicated))
    optimizer = nnx.Optimizer(model, optax.identity(), wrt=wrt)  # no state to re-lay out
    optimizer.tx = tx
    optimizer.opt_state = nnx.data(to_opt_state(opt_state))
    return optimizer


def _spec(x: Any) -> P:
    sharding = getattr(x, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


@contextlib.contextmanager
def _per_device_rngs(model: nnx.Module, axis_name: str) -> Iterator[None]:
    """Inside: every ``nnx.Rngs`` stream of ``model`` folded with the device index, so
    dropout masks differ across devices; afterwards the keys are the shared ones again
    (their counts advance as usual)."""
    keys = nnx.as_pure(nnx.state(model, nnx.RngKey))
    index = jax.lax.axis_index(axis_name)
    nnx.update(model, jax.tree.map(lambda k: jax.random.fold_in(k, index), keys))
    yield
    nnx.update(model, keys)


def _sync_nnx_batch_norm(model: nnx.Module, axis_name: str) -> None:
    """Makes every ``nnx.BatchNorm`` without an ``axis_name`` use global-batch statistics."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            module.axis_name = axis_name


class NNXTrainStep:
    """``metrics = train_step(model, optimizer, batch)``; see :func:`nnx_train_step`."""

    def __init__(self, loss_fn, mesh, axis_name: str, has_aux: bool, donate: bool, sync: bool):
        self.loss_fn, self.mesh, self.axis_name, self.has_aux = loss_fn, mesh, axis_name, has_aux
        self.num_shards = mesh.shape[axis_name]
        self._donate, self._sync = donate, sync
        # The step runs on an Auto-typed twin of the mesh (same devices, same layouts,
        # no copies): the model's own sharding calls work there, under vmap over devices.
        self._auto_mesh = auto_twin(mesh)
        self._compiled: dict[Any, Callable] = {}

    def _gradients(self, model_def, wrt, params, rest, batch):
        """Each device's loss, aux, model state and local gradients: the model runs on
        one device's rows under ``vmap`` over the data axis, in the mesh's own sharding
        (so annotations and ``out_sharding=`` calls inside the model work)."""
        axis = self.axis_name

        def device_loss(params, rest, rows):
            model = nnx.merge(model_def, params, rest)
            if self._sync:
                _sync_nnx_batch_norm(model, axis)
            with _per_device_rngs(model, axis):
                out = self.loss_fn(model, rows)
            loss, aux = out if self.has_aux else (out, None)
            return loss, (aux, nnx.as_pure(nnx.state(model, nnx.Not(wrt))))

        grad_fn = jax.value_and_grad(device_loss, has_aux=True)
        vmapped = jax.vmap(grad_fn, in_axes=(None, None, 0), axis_name=axis, spmd_axis_name=axis)
        return vmapped(params, rest, batch)

    def _build(self, graphdef: Any, param_specs: PyTree) -> Callable:
        axis, mesh = self.axis_name, self._auto_mesh

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, dict]:
            model, optimizer = nnx.merge(graphdef, state)
            model_def, params, rest = nnx.split(model, optimizer.wrt, ...)
            params, rest = nnx.as_pure(params), nnx.as_pure(rest)
            (loss, (aux, rests)), grads = self._gradients(
                model_def, optimizer.wrt, params, rest, batch
            )
            nnx.update(model, jax.tree.map(_across_devices, rests))
            # The update: manual over every mesh axis, the state replicated over all but
            # the data axis; then the parameters return to their own shardings.
            tx, old_state = optimizer.tx, nnx.as_pure(optimizer.opt_state)
            specs = tx.state_specs(params, self.num_shards)
            update = jax.shard_map(
                lambda g, s, p: tx.sharding.apply(jax.tree.map(lambda x: x[0], g), s, p),
                mesh=mesh,
                in_specs=(P(axis), specs, P()),
                out_specs=(P(), specs),
                axis_names=set(mesh.axis_names),
            )
            constrain = lambda x, spec: jax.lax.with_sharding_constraint(
                x, NamedSharding(mesh, spec)
            )
            grads = jax.tree.map(lambda g: constrain(g, P(axis)), grads)
            params = jax.tree.map(lambda p: constrain(p, P()), params)
            new, opt_state = update(grads, old_state, params)
            nnx.update(model, jax.tree.map(constrain, new, param_specs))
            nnx.update(optimizer.opt_state, nnx.state(opt_state))
            optimizer.step[...] += 1
            rows = jax.tree.leaves(batch)[0].shape[1]
            metrics = {"loss": jnp.mean(loss.astype(jnp.float32)), "grad_norm": opt_state.grad_norm}
            if aux is not None:
                metrics["aux"] = jax.tree.map(lambda x: stacked_aux(x, rows), aux)
            metrics.update(update_metrics(tx.config, old_state, opt_state))
            return nnx.state((model, optimizer)), metrics

        return jax.jit(step, donate_argnums=(0,) if self._donate else ())

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> dict:
        if not isinstance(getattr(optimizer, "tx", None), ShardedTransformation):
            raise TypeError(
                "nnx_train_step needs the optimizer from zeroshard.flax.nnx_optimizer(model, "
                "zs.sharded(inner), mesh), not a plain nnx.Optimizer."
            )
        check_batch(batch, self.num_shards, self.axis_name)
        graphdef, state = nnx.split((model, optimizer))
        specs = jax.tree.map(_spec, state)
        param_specs = jax.tree.map(_spec, nnx.as_pure(nnx.state(model, optimizer.wrt)))
        key = (graphdef, jax.tree.structure(state), tuple(jax.tree.leaves(specs)))
        if key not in self._compiled:
            self._compiled[key] = self._build(graphdef, param_specs)
        auto = self._auto_mesh
        state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(auto, s), specs))
        n = self.num_shards
        batch = jax.tree.map(lambda x: jnp.reshape(x, (n, -1, *jnp.shape(x)[1:])), batch)
        batch = jax.device_put(batch, NamedSharding(auto, P(self.axis_name)))
        with jax.set_mesh(auto):
            state, metrics = self._compiled[key](state, batch)
        state, metrics = plain_outputs((state, metrics), self.mesh)
        nnx.update((model, optimizer), state)
        return metrics


def _across_devices(x: jax.Array) -> jax.Array:
    """One device's value from a ``vmap`` over devices: the mean of floating-point
    state (e.g. BatchNorm statistics), the first device's otherwise (counts, keys)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.mean(x, axis=0).astype(x.dtype)
    return x[0]


def nnx_train_step(
    loss_fn: Callable[[nnx.Module, PyTree], Any],
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = "data",
    has_aux: bool = False,
    donate: bool = True,
    sync_batch_stats: bool = True,
) -> NNXTrainStep:
    """A jitted ZeRO-1 step for an NNX model and its :func:`nnx_optimizer`.

    The model runs as written: ``nnx.Dropout`` draws from the model's ``nnx.Rngs``,
    folded with the device index so the masks differ across devices (the same seed
    gives the same run); ``nnx.BatchNorm`` (and any other non-``wrt`` variable) is
    updated in the step and averaged over the devices, so it stays identical on all.

    The forward and backward pass run once per device under ``jax.vmap`` over
    ``axis_name``, on a twin of ``mesh`` whose axes are all ``Auto``: sharding
    annotations and ``out_sharding=`` calls in the model work, and parameters keep
    their layout over the mesh's other axes (tensor parallelism). The update runs in
    a ``shard_map`` manual over every mesh axis: reduce-scatter of the local
    gradients over ``axis_name``, the sharded update, all-gather of the new weights.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar`` (or ``(scalar, aux)``), the mean
        loss over the batch it is given.
      mesh: the device mesh.
      axis_name: the axis the batch's leading dimension is split over.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``. Aux leaves with a leading
        batch dimension come back as the global per-example arrays (e.g. logits for
        ``nnx.metrics.Accuracy``); other aux is averaged over the devices.
      donate: donate the model's and optimizer's buffers to their updated values.
      sync_batch_stats: normalise with global-batch statistics (every
        ``nnx.BatchNorm`` without an ``axis_name`` gets ``axis_name``), as one device
        would on the whole batch; ``False`` normalises with each device's own rows
        (the running statistics are averaged either way).

    Returns:
      ``train_step(model, optimizer, batch) -> metrics`` (global mean ``"loss"``,
      ``"grad_norm"``, ``"skipped"`` and ``"aux"``, as :func:`zeroshard.make_train_step`
      reports them), updating ``model`` and ``optimizer`` in place.
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r} (its axes: {mesh.axis_names}).")
    return NNXTrainStep(loss_fn, mesh, axis_name, has_aux, donate, sync_batch_stats)


# Linen (flax.training.train_state.TrainState).


class LinenTrainState(linen_train_state_lib.TrainState):
    """Flax's ``TrainState`` plus ``model_state``: the non-``params`` collections
    (e.g. ``{"batch_stats": ...}``), replicated, or ``None``."""

    model_state: Any = None


def linen_train_state(
    apply_fn: Callable[..., Any],
    params: PyTree,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    param_dtype: Any = None,
    model_state: PyTree = None,
) -> LinenTrainState:
    """``flax.training.train_state.TrainState.create`` for a sharded optimizer.

    Args:
      apply_fn: the Linen model's ``apply``.
      params: the initial parameters; the master weights start from them as given.
      tx: an optimizer from :func:`zeroshard.sharded` over ``axis_name``.
      mesh: the device mesh.
      axis_name: the data-parallel axis (default: the optimizer's).
      param_dtype: compute dtype of the replicated parameters (``None``: as given).
      model_state: the model's other collections, e.g. ``{"batch_stats":
        variables["batch_stats"]}`` for BatchNorm; see :func:`linen_train_step`.

    Returns:
      A :class:`LinenTrainState` (a Flax ``TrainState``): params replicated,
      ``opt_state`` 1/N per device.
    """
    axis_name = _check_flax_setup(tx, mesh, axis_name)
    check_other_axes(mesh, (axis_name,))

    def local(master: PyTree, model_state: PyTree) -> LinenTrainState:
        cast = lambda x: jnp.array(x, dtype=param_dtype or x.dtype, copy=True)
        params = jax.tree.map(cast, master)
        return LinenTrainState(
            step=jnp.zeros((), jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=tx.sharding.init_local(params, master),
            model_state=jax.tree.map(lambda x: jnp.array(x, copy=True), model_state),
        )

    compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype or x.dtype), params)
    specs = _linen_specs(tx, apply_fn, compute, mesh.shape[axis_name])
    init = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P()), out_specs=specs, axis_names={axis_name}
    )
    return jax.jit(init)(*jax.device_put((params, model_state), NamedSharding(mesh, P())))


def _linen_specs(tx, apply_fn, params, num_shards) -> LinenTrainState:
    return LinenTrainState(
        step=P(),
        apply_fn=apply_fn,
        params=P(),
        tx=tx,
        opt_state=tx.state_specs(params, num_shards),
        model_state=P(),
    )


@contextlib.contextmanager
def _synced_linen_batch_norm(axis_name: str) -> Iterator[None]:
    """Inside: every ``nn.BatchNorm`` without an ``axis_name`` normalises with
    global-batch statistics, as if built with ``axis_name``."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if not isinstance(module, nn.BatchNorm) or module.axis_name is not None:
            return next_fun(*args, **kwargs)
        object.__setattr__(module, "axis_name", axis_name)
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "axis_name", None)

    with nn.intercept_methods(interceptor):
        yield


def linen_train_step(
    loss_fn: Callable[..., Any],
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    has_aux: bool = False,
    donate: bool = True,
    sync_batch_stats: bool = True,
) -> Callable[..., tuple[LinenTrainState, dict]]:
    """A jitted ZeRO-1 step for a Flax ``TrainState`` from :func:`linen_train_state`.

    Each device differentiates ``loss_fn`` on its share of the batch; then
    ``state.apply_gradients`` runs the sharded optimizer (reduce-scatter, update of
    this device's slice, all-gather). ``train_step(state, batch, key)`` passes
    ``key=`` (folded with the device index: a distinct dropout stream per device) and,
    when the state has a ``model_state``, ``model_state=`` to the loss, as
    :func:`zeroshard.make_train_step` does::

        def loss_fn(params, batch, key, model_state):
            logits, updates = model.apply({"params": params, **model_state}, batch["x"],
                                          rngs={"dropout": key}, mutable=["batch_stats"])
            return loss(logits, batch), updates

    Args:
      loss_fn: ``loss_fn(params, batch, **extras) -> scalar`` (or ``(scalar, aux)``);
        see :func:`zeroshard.make_train_step` for the extras and what to return with
        a model state.
      tx: the state's optimizer, from :func:`zeroshard.sharded`.
      mesh: the device mesh.
      axis_name: the axis the batch's leading dimension is split over.
      has_aux: whether ``loss_fn`` returns aux; per-example aux (a leading batch
        dimension) comes back as the global per-example array, other aux averaged.
      donate: donate the input state's buffers.
      sync_batch_stats: every ``nn.BatchNorm`` without an ``axis_name`` normalises
        with global-batch statistics, as one device would on the whole batch;
        ``False``: with each device's own rows (the collections returned are averaged
        over the devices either way).

    Returns:
      ``train_step(state, batch, key=None) -> (state, metrics)``; ``metrics`` as
      :func:`zeroshard.make_train_step` reports them (``"loss"``, ``"grad_norm"``,
      ``"skipped"``, and ``"aux"``).
    """
    axis_name = _check_flax_setup(tx, mesh, axis_name)
    check_other_axes(mesh, (axis_name,))
    num_shards = mesh.shape[axis_name]

    def local(state, batch, key):
        local_params = jax.lax.pcast(state.params, axis_name, to="varying")
        model_state = getattr(state, "model_state", None)
        key = device_key(key, axis_name)
        loss = lambda p: call_loss(loss_fn, has_aux, p, batch, key, model_state)
        synced = _synced_linen_batch_norm if sync_batch_stats else contextlib.nullcontext
        with synced(axis_name):
            (loss, (aux, model_state)), grads = jax.value_and_grad(loss, has_aux=True)(local_params)
        before = state.opt_state
        state = state.apply_gradients(grads=grads)
        if model_state is not None:
            state = state.replace(model_state=mean_state(model_state, axis_name))
        grad_norm = state.opt_state.grad_norm
        metrics = step_metrics(loss, aux, grad_norm, axis_name, local_rows(batch))
        metrics.update(update_metrics(sharding_of(tx).config, before, state.opt_state))
        return state, metrics

    def global_step(state, batch, key):
        check_batch(batch, num_shards, axis_name)
        if not isinstance(state, LinenTrainState):
            state = LinenTrainState(**{f: getattr(state, f) for f in _FIELDS}, model_state=None)
        specs = _linen_specs(tx, state.apply_fn, state.params, num_shards)
        step = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs, P(axis_name), P()),
            out_specs=(specs, P()),
            axis_names={axis_name},
        )
        return step(state, batch, key)

    jitted = jax.jit(global_step, donate_argnums=(0,) if donate else ())
    batch_sharding = NamedSharding(mesh, P(axis_name))

    def train_step(state, batch, key=None):
        check_batch(batch, num_shards, axis_name)
        state, metrics = jitted(state, jax.device_put(batch, batch_sharding), key)
        return state, plain_outputs(metrics, mesh)

    train_step.jitted = jitted
    return train_step


_FIELDS = ("step", "apply_fn", "params", "tx", "opt_state")


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
    graphdef, _, rest = nnx.split(module, nnx.Param, ...)

    def apply(params: PyTree, *args: Any) -> Any:
        return nnx.merge(graphdef, nnx.State(params), rest)(*args)

    return layer(apply, axis_name)
