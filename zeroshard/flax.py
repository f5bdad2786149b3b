"""Flax integration: zeroshard's step for NNX models and Linen's ``TrainState``.

The optimizer from :func:`zeroshard.sharded` is an ordinary optax transformation, so
it is the ``tx`` of ``flax.nnx.Optimizer`` and of
``flax.training.train_state.TrainState``. What these helpers add is the placement
(parameters replicated in the compute dtype, optimizer state and master weights
sharded over the data axis) and adapters that hand :func:`zeroshard.make_train_step`
the model's parameters and a loss: stages, accumulation, loss scaling, a replica axis
and the metrics are that step's.

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

Stage 3 (weights as 1/N pieces, gathered layer by layer) works on the state from
``zs.init_train_state(params, tx, mesh, stage=3)`` or
``zs.flax.linen_train_state(..., stage=3)``; these helpers make Flax layers gather
their own weights:

- Linen: call a layer as ``zs.flax.linen_layer(nn.Dense(256))(params["Dense_0"], x)``;
- NNX: call a layer as ``zs.flax.nnx_layer(model.layer)(params["layer"], x)``;

where the first argument is that layer's ``Piece`` subtree of the state's params.
Each gathers the layer's weights (one all-gather per dtype) and gathers them again
in the backward pass. In your own ``nnx.jit`` / ``jax.jit`` step (the one-line
drop-in at ``zs.sharded(inner, stage=3)``, with ``nnx.Optimizer`` or Linen's
``TrainState``) the model is marked instead, its code as written:
:func:`nnx_gathered` marks NNX modules in place, :func:`linen_gathered` wraps a Linen
module class.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.errors import TraceContextError
from flax.nnx.training.optimizer import to_opt_state
from flax.training import train_state as linen_train_state_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.stage3 import gather, layer
from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import check_mesh, sharding_of
from zeroshard.optimizer.sharded import ShardedTransformation, optimizer_of
from zeroshard.optimizer.state import key_of
from zeroshard.training.step import TrainState, TrainStep, init_train_state
from zeroshard.training.step_io import output_mesh, plain_outputs


def _placed_copy(tree: PyTree, mesh: jax.sharding.Mesh, axis_name: str) -> PyTree:
    """``tree`` on ``mesh`` in fresh buffers: replicated over ``axis_name``, and laid out
    over the mesh's other axes as it already was (the model's sharding annotations)."""

    def spec(x: Any) -> P:
        sharding = sharding_of(x)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
            return P()
        drop = lambda e: (
            tuple(a for a in e if a != axis_name) or None if isinstance(e, tuple) else e
        )
        return P(*(None if e == axis_name else drop(e) for e in sharding.spec))

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
    stage: int = 1,
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
      stage: the ZeRO stage the step will run (3: the model's parameters become
        :class:`zeroshard.Piece` pieces, which its layers gather with
        :func:`nnx_layer`).

    Returns:
      An ``nnx.Optimizer(model, tx, wrt=wrt)`` with its state 1/N per device.
    """
    axis_name = check_mesh(optimizer_of(tx).config, mesh, axis_name)
    master = nnx.as_pure(nnx.state(model, wrt))
    nnx.update(model, jax.tree.map(lambda x: x.astype(param_dtype or x.dtype), master))
    nnx.update(model, _placed_copy(nnx.state(model), mesh, axis_name))
    state = init_train_state(master, tx, mesh, param_dtype=param_dtype, stage=stage)
    if key_of(state.opt_state).pieces:  # (stage 3: the pieces, from the same masters)
        nnx.update(model, state.params)
    optimizer = nnx.Optimizer(model, optax.identity(), wrt=wrt)  # no state to re-lay out
    optimizer.tx = tx
    optimizer.opt_state = nnx.data(to_opt_state(state.opt_state))
    return optimizer


def _spec(x: Any) -> P:
    sharding = sharding_of(x)
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


@contextlib.contextmanager
def _per_device(model: nnx.Module, axes: Any, sync: bool) -> Iterator[None]:
    """Inside: ``model`` as it runs on one device of the step, where the batch ``axes``
    are manual (on the whole mesh, as it is). With ``sync``, every ``nnx.BatchNorm``
    without an ``axis_name`` uses global-batch statistics (over ``axes``). Every
    ``nnx.Rngs`` stream is folded with the device index, so dropout masks differ
    across devices; afterwards the keys are the shared ones again (their counts
    advance as usual)."""
    norms = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.BatchNorm)]
    norms = [m for m in norms if m.axis_name is None]
    if not set(axes) <= set(jax.sharding.get_abstract_mesh().manual_axes):
        if norms and not sync:
            raise ValueError(
                "nnx_train_step(sync_batch_stats=False): this model runs on the whole mesh "
                "(its own sharding calls do not run per device), where BatchNorm normalises "
                "over the global batch. Leave sync_batch_stats at True, or make the model's "
                "sharding calls run per device."
            )
        yield
        return
    for module in norms if sync else ():
        module.axis_name = axes
    keys = nnx.as_pure(nnx.state(model, nnx.RngKey))
    index = jax.lax.axis_index(axes)
    nnx.update(model, jax.tree.map(lambda k: jax.random.fold_in(k, index), keys))
    yield
    nnx.update(model, keys)


class NNXTrainStep:
    """``metrics = train_step(model, optimizer, batch)``; see :func:`nnx_train_step`."""

    def __init__(self, loss_fn: Callable[..., Any], mesh: Any, sync: bool, options: dict):
        # options: the TrainStep's (axis_name, has_aux, donate, stage, accum_steps).
        self.loss_fn, self.mesh, self._sync, self._options = loss_fn, mesh, sync, options
        self._compiled: dict[Any, TrainStep] = {}

    def _loss(self, graphdef: Any, wrt: Any, axes: tuple) -> Callable[..., Any]:
        """The model's loss as :func:`zeroshard.make_train_step` takes it: of the
        ``wrt`` parameters, with the model's other variables as its model state; run
        per device over the batch ``axes``, or on the whole mesh."""

        def loss(params, batch, model_state):
            model = nnx.merge(graphdef, params, model_state)
            with _per_device(model, axes, self._sync):
                out = self.loss_fn(model, batch)
            rest = nnx.as_pure(nnx.state(model, nnx.Not(wrt)))
            return (out[0], (rest, out[1])) if self._options["has_aux"] else (out, rest)

        return loss

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> dict:
        tx = getattr(optimizer, "tx", None)
        if not isinstance(tx, ShardedTransformation):
            raise TypeError(
                "nnx_train_step needs the optimizer from zeroshard.flax.nnx_optimizer(model, "
                "zs.sharded(inner), mesh), not a plain nnx.Optimizer."
            )
        graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)
        state = TrainState(*nnx.as_pure((optimizer.step[...], params, optimizer.opt_state, rest)))
        specs = jax.tree.map(_spec, state)
        key = (graphdef, jax.tree.structure(state), tuple(jax.tree.leaves(specs)))
        if key not in self._compiled:
            loss = self._loss(graphdef, optimizer.wrt, tx.config.batch_axes)
            self._compiled[key] = TrainStep(loss, tx, self.mesh, **self._options)
        on = lambda mesh: jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        with jax.set_mesh(self.mesh):
            state, metrics = self._compiled[key](jax.device_put(state, on(self.mesh)), batch)
        state = jax.device_put(state, on(output_mesh(self.mesh)))
        nnx.update(model, state.params, state.model_state)
        nnx.update(optimizer.opt_state, nnx.state(state.opt_state))
        optimizer.step.set_raw_value(state.step)
        return plain_outputs(metrics, self.mesh)  # (typed outside the step's mesh context)


def nnx_train_step(
    loss_fn: Callable[[nnx.Module, PyTree], Any],
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | None = None,
    has_aux: bool = False,
    donate: bool = True,
    sync_batch_stats: bool = True,
    stage: int = 1,
    accum_steps: int = 1,
) -> NNXTrainStep:
    """A jitted ZeRO step for an NNX model and its :func:`nnx_optimizer`.

    An adapter: the step is :func:`zeroshard.make_train_step`'s for the model's
    ``wrt`` parameters and a loss that runs ``loss_fn`` on the model, with the model's
    other variables (BatchNorm statistics, ``nnx.Rngs`` counts) as its model state. So
    stages 2 and 3, accumulation, loss scaling (``zs.sharded(..., loss_scale=...)``)
    and a replica axis work as they do there.

    The model runs as written: ``nnx.Dropout`` draws from the model's ``nnx.Rngs``,
    folded with the device index so the masks differ across devices (the same seed
    gives the same run); ``nnx.BatchNorm`` (and any other non-``wrt`` variable) is
    updated in the step and averaged over the devices, so it stays identical on all.
    The model runs inside the step's ``shard_map``, manual over the batch axes, and
    its parameters keep their layout over the mesh's other axes (tensor parallelism).
    A model whose own sharding calls fail there (they name the batch axis, pass a
    ``PartitionSpec`` to ``reshard``, or leave the manual axis with ``auto_axes``, as
    ``nnx.Embed``'s ``out_sharding=`` does) runs, without micro-batches, on
    the whole mesh under ``jax.jit`` instead, as
    :func:`zeroshard.make_train_step` runs such a loss (:mod:`zeroshard.training.whole_mesh`):
    one dropout stream and BatchNorm statistics over the global batch;
    elsewhere jax's error is raised with a note.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar`` (or ``(scalar, aux)``), the mean
        loss over the batch it is given.
      mesh: the device mesh.
      axis_name: the axis the optimizer state is sharded over (default: the
        optimizer's); the batch's leading dimension is split over it.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``. Aux leaves with a leading
        batch dimension come back as the global per-example arrays (e.g. logits for
        ``nnx.metrics.Accuracy``); other aux is averaged over the devices.
      donate: donate the model's and optimizer's buffers to their updated values.
      sync_batch_stats: normalise with global-batch statistics (every
        ``nnx.BatchNorm`` without an ``axis_name`` gets the batch axes), as one device
        would on the whole batch; ``False`` normalises with each device's own rows
        (the running statistics are averaged either way).
      stage: 1, 2 or 3 (see :func:`zeroshard.make_train_step`); for 3, the optimizer
        from ``nnx_optimizer(..., stage=3)``, and ``loss_fn`` gathers each layer's
        weights with :func:`nnx_layer`.
      accum_steps: micro-batches per step (see :func:`zeroshard.make_train_step`).

    Returns:
      ``train_step(model, optimizer, batch) -> metrics`` (as
      :func:`zeroshard.make_train_step` reports them), updating ``model`` and
      ``optimizer`` in place.
    """
    if axis_name is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r} (its axes: {mesh.axis_names}).")
    options = dict(
        axis_name=axis_name, has_aux=has_aux, donate=donate, stage=stage, accum_steps=accum_steps
    )
    return NNXTrainStep(loss_fn, mesh, sync_batch_stats, options)


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
    stage: int = 1,
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
      stage: the ZeRO stage the state is for (3: the params are
        :class:`zeroshard.Piece` pieces; see :func:`linen_layer`).

    Returns:
      A :class:`LinenTrainState` (a Flax ``TrainState``): params replicated (pieces
      in stage 3), ``opt_state`` 1/N per device.
    """
    state = init_train_state(
        params,
        tx,
        mesh,
        axis_name=axis_name,
        param_dtype=param_dtype,
        stage=stage,
        model_state=model_state,
    )
    return LinenTrainState(apply_fn=apply_fn, tx=tx, **state._asdict())


@contextlib.contextmanager
def _synced_linen_batch_norm(axis_name: Any) -> Iterator[None]:
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
    stage: int = 1,
    accum_steps: int = 1,
) -> Callable[..., tuple[Any, dict]]:
    """A jitted ZeRO step for a Flax ``TrainState`` from :func:`linen_train_state`.

    An adapter: the step is :func:`zeroshard.make_train_step`'s for ``loss_fn``, on the
    state's ``params``, ``opt_state`` and ``model_state``; stages 1-3, accumulation,
    loss scaling and a replica axis work as they do there. ``train_step(state, batch,
    key)`` passes ``key=`` (folded with the device index: a distinct dropout stream per
    device) and, when the state has a ``model_state``, ``model_state=`` to the loss::

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
      axis_name: the axis the optimizer state is sharded over (default: the
        optimizer's); the batch's leading dimension is split over it.
      has_aux: whether ``loss_fn`` returns aux; per-example aux (a leading batch
        dimension) comes back as the global per-example array, other aux averaged.
      donate: donate the input state's buffers.
      sync_batch_stats: every ``nn.BatchNorm`` without an ``axis_name`` normalises
        with global-batch statistics, as one device would on the whole batch;
        ``False``: with each device's own rows (the collections returned are averaged
        over the devices either way).
      stage: 1, 2 or 3 (the state from ``linen_train_state(..., stage=3)``).
      accum_steps: micro-batches per step.

    Returns:
      ``train_step(state, batch, key=None) -> (state, metrics)``; ``metrics`` as
      :func:`zeroshard.make_train_step` reports them. ``train_step.jitted`` is the
      underlying ``jax.jit`` function.
    """

    def synced_loss(*args: Any, **kwargs: Any) -> Any:
        with _synced_linen_batch_norm(step.batch_axes):  # (called once the step is built)
            return loss_fn(*args, **kwargs)

    loss = synced_loss if sync_batch_stats else loss_fn
    step = TrainStep(loss, tx, mesh, axis_name, has_aux, donate, stage, accum_steps)

    def train_step(state: Any, batch: PyTree, key: jax.Array | None = None) -> tuple[Any, dict]:
        # The TrainState fields the Flax state has (a plain TrainState: no model_state).
        fields = [f for f in TrainState._fields if hasattr(state, f)]
        new, metrics = step(TrainState(*(getattr(state, f) for f in fields)), batch, key)
        train_step.jitted = step.jitted  # (the function for this state: see TrainStep)
        return state.replace(**{f: getattr(new, f) for f in fields}), metrics

    train_step.jitted = step.jitted
    return train_step


# Stage 3: per-layer gathering.


def linen_layer(module: Any, axis_name: str | None = None) -> Callable[..., Any]:
    """``fn(layer_params, *args)``: applies a Linen module to gathered weights (stage 3).

    Args:
      module: an (unbound) Linen module, e.g. ``nn.Dense(256)``.
      axis_name: the axis the pieces are spread over; ``None`` (default): the axis of
        the zeroshard step the layer runs in (see :func:`zeroshard.gather`).

    Returns:
      ``module.apply({"params": gather(layer_params)}, *args)`` as a function of the
      module's ``Piece`` parameters and the call's arguments, with the weights gathered
      again in the backward pass (:func:`zeroshard.layer`).
    """
    return layer(lambda params, *args: module.apply({"params": params}, *args), axis_name)


def linen_gathered(module: type[nn.Module], axis_name: str | None = None) -> type[nn.Module]:
    """A Linen module class (a block, e.g. inside ``nn.scan``, or ``nn.Dense``) that
    gathers its weights right before it runs and again in the backward pass, for
    stage 3 in your own ``jax.jit`` step (``zs.sharded(inner, stage=3)``, the weights
    laid out by ``tx.shard_params``): ``nn.remat`` of ``nn.map_variables`` with
    :func:`zeroshard.gather` on its ``"params"``. Give it an explicit ``name=``
    where the parameters' names must stay those of ``module``."""
    gathered = lambda params: gather(params, axis_name)
    mapped = nn.map_variables(module, "params", trans_in_fn=gathered, init=True)
    return nn.remat(mapped, policy=jax.checkpoint_policies.nothing_saveable)


def nnx_layer(module: nnx.Module, axis_name: str | None = None) -> Callable[..., Any]:
    """``fn(layer_params, *args)``: runs an NNX module on gathered weights (stage 3).

    Args:
      module: the NNX module (its own parameter values are not used: only its
        structure and non-parameter state).
      axis_name: the axis the pieces are spread over; ``None`` (default): the axis of
        the zeroshard step the layer runs in (see :func:`zeroshard.gather`).

    Returns:
      A function of the module's ``Piece`` parameters (the pure-dict subtree, as in
      ``nnx.to_pure_dict(nnx.state(module, nnx.Param))``) and the call's arguments. It
      gathers the weights with one all-gather per dtype and recomputes them in the
      backward pass (:func:`zeroshard.layer`).
    """
    graphdef, _, rest = nnx.split(module, nnx.Param, ...)

    def apply(params: PyTree, *args: Any) -> Any:
        return nnx.merge(graphdef, nnx.State(params), rest)(*args)

    return layer(apply, axis_name)


def nnx_gathered(*modules: nnx.Module, axis_name: str | None = None) -> None:
    """Marks NNX modules, in place, for stage 3 in your own ``nnx.jit`` step
    (``zs.sharded(inner, stage=3)``, the weights laid out by ``tx.shard_params``):
    each call of a marked module, and of each public method its model's classes
    define (a tied embedding's ``encode`` and ``attend``; ``nnx.Embed.attend``),
    gathers its weights right before it runs and again in the backward pass
    (:func:`zeroshard.layer`). Its code and state stay as they are (its class becomes
    a subclass that does this). Mark each block of a list of blocks, and the large
    modules used outside them (the embeddings, the head); an unmarked one's weights
    are gathered by the compiler where they are read.

    Args:
      *modules: the modules to mark.
      axis_name: the axes the pieces are cut over; ``None`` (default): those of the
        optimizer's state, every axis of the mesh (name the batch axes to keep a
        tensor-parallel split within its blocks).

    Raises:
      ValueError: when a marked call changes the module's own state (a ``Dropout``'s
        random stream in training, ``BatchNorm``'s statistics): they would be lost.
    """
    for module in modules:
        module.__class__ = _gathering(type(module), axis_name)


@functools.cache
def _gathering(cls: type, axis_name: str | None) -> type:
    """``cls`` whose calls gather its weights (see :func:`nnx_gathered`)."""
    base = next(c for c in cls.__mro__ if "_zeroshard_gathers" not in vars(c))
    # (the call, nnx.Embed's attend, and the public methods of the model's own
    # classes; not flax's others, such as attention's init_cache, which makes state)
    mine = lambda c, n: not c.__module__.startswith("flax.") and not n.startswith("_")
    names = {
        n
        for c in base.__mro__[: base.__mro__.index(nnx.Module)]
        for n, f in vars(c).items()
        if inspect.isfunction(f) and (n in ("__call__", "attend") or mine(c, n))
    }

    def gathering(name: str) -> Callable[..., Any]:
        def method(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
            graphdef, params, rest = nnx.split(self, nnx.Param, ...)

            def run(params: PyTree, *args: Any) -> Any:
                try:
                    module = nnx.merge(graphdef, params, rest)
                    return getattr(base, name)(module, *args, **kwargs)
                except TraceContextError as error:  # (flax refuses the change)
                    call = "call" if name == "__call__" else name
                    raise ValueError(
                        f"zf.nnx_gathered: {base.__name__}'s {call} changes its own state "
                        "(a Dropout's random stream in training, BatchNorm's statistics), "
                        "which a gathering call cannot keep. Mark its stateless parts "
                        "instead, or call it in eval mode."
                    ) from error

            return layer(run, axis_name)(params, *args)

        return functools.wraps(getattr(base, name))(method)

    methods = {n: gathering(n) for n in sorted(names)}
    return type(base.__name__, (base,), {**methods, "_zeroshard_gathers": True})
