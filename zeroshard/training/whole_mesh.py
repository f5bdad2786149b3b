"""The step on the whole mesh, for a loss whose own sharding calls cannot run per device.

zeroshard's steps run the loss with the batch axis manual. A model written for jax's
Explicit meshes may name that axis in its own
sharding calls (``jnp.dot(h, w, out_sharding=P("data", None))``) or pass a
``PartitionSpec`` to ``reshard``, which jax refuses there ("... cannot contain axis
names that are of type Auto or Manual"). Such a loss trains under the user's own
``jax.jit`` on the mesh, and so it does here: :func:`whole_mesh_step` runs it on the
global batch under ``jax.jit`` on the mesh as given (the compiler reduces the
gradient), then the sharded update of the mean gradient
(:meth:`zeroshard.optimizer.sharded.Sharded.apply_mean`, the one-line drop-in's) on the state
as the step laid it out. At stage 3 the step's pieces are the drop-in's weights: the
loss's ``zs.gather`` / ``zs.layer`` gather them as in the user's own ``jax.jit``, and
the drop-in's stage-3 update (:func:`zeroshard.communication.jit_pieces.apply_pieces`) keeps them
pieces. The steps fall back
to it when the loss raises per device, so the same loss works with no option to set.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.jit_pieces import apply_pieces
from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import StepContext, in_step
from zeroshard.core.state_layout import drop_in_is_step, state_layout
from zeroshard.core.update import kept_apart
from zeroshard.optimizer.sharded import optimizer_of
from zeroshard.optimizer.state import TrainState, key_of
from zeroshard.training.step_io import placed, step_loss, step_metrics

logger = logging.getLogger(__name__)


class WholeMeshStep:
    """``state, metrics = step(state, batch[, key])``: ``loss_fn`` (in the convention
    of :func:`zeroshard.make_train_step`) on the global batch under ``jax.jit`` on
    ``mesh``, and the drop-in's update; built by :func:`whole_mesh_step`."""

    def __init__(self, loss_fn: Callable[..., Any], tx: Any, mesh: Any, options: dict):
        self.tx, self.opt, self.mesh = tx, optimizer_of(tx), mesh
        self.loss_fn, self.has_aux = loss_fn, options["has_aux"]
        # (stage 3, the step's config's: the drop-in's, whose pieces are the step's bytes)
        self.pieces = kept_apart(self.opt.config.stage)[2]
        self.three = self.opt.spanning(mesh)
        donate = (0,) if options["donate"] else ()
        self.jitted = jax.jit(self._step, static_argnums=3, donate_argnums=donate)

    def _step(self, state: TrainState, batch: PyTree, key: Any, splits: tuple) -> Any:
        scale = state.opt_state.loss_scale  # (the update divides the gradients by it)
        loss_fn = step_loss(self.loss_fn, self.has_aux, scale)
        value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
        with in_step(StepContext(self.opt.config.batch_axes, None)):  # (zs.gather: as in jit)
            (loss, (aux, model_state)), grads = value_and_grad(
                state.params, batch, key, state.model_state
            )
        loss = loss if scale is None else loss / scale.scale
        if self.pieces:  # (the drop-in's update of its weights, as pieces again)
            made = key_of(state.opt_state)  # (the drop-in's state's, then the step's again)
            opt_state = state.opt_state._replace(layout=dataclasses.replace(made, pieces=False))
            params, opt_state = apply_pieces(self.three, grads, opt_state, state.params, {})
            opt_state = opt_state._replace(layout=made)
        else:  # (the state kept as zeroshard's step keeps it)
            update = self.opt.apply_mean
            params, opt_state = update(grads, state.opt_state, state.params, {}, dict(splits))
        states = (state.opt_state, opt_state)
        metrics = step_metrics(self.opt.config, loss, aux, batch, (), states, reduced=True)
        return TrainState(state.step + 1, params, opt_state, model_state), metrics

    def _args(self, state: TrainState, batch: PyTree, key: Any) -> tuple:
        batch = placed(batch, NamedSharding(self.mesh, P(self.opt.config.batch_axes)))
        # (the drop-in's stage 3: its own splits)
        splits = () if self.pieces else state_layout(self.tx, self.mesh, state.params).splits
        return state, batch, key, splits

    def __call__(self, state: TrainState, batch: PyTree, key: Any = None) -> Any:
        return self.jitted(*self._args(state, batch, key))

    def lower(self, state: TrainState, batch: PyTree, key: Any = None) -> jax.stages.Lowered:
        """The step lowered for ``state`` and ``batch``, without running it."""
        return self.jitted.lower(*self._args(state, batch, key))


REFUSED = (ValueError, NotImplementedError)
"""What jax raises for a sharding call over a manual axis: a ``PartitionSpec`` naming
it (``ValueError``), or ``auto_axes`` leaving it (``NotImplementedError``)."""


class Fallback:
    """The loss of ``step`` (a :class:`zeroshard.training.step.TrainStep`), recording jax's
    refusal of a sharding call over an axis the step runs manual over (:data:`REFUSED`:
    an ``out_sharding=`` or ``reshard`` naming it, an ``auto_axes`` such as
    ``nnx.Embed``'s ``out_sharding=`` leaving it), raised while traced, and the
    :class:`WholeMeshStep` the step falls back to once it has."""

    def __init__(self, step: Any):
        options = {k: getattr(step, k) for k in ("accum_steps", "has_aux", "donate")}
        self.loss_fn, self.args = step.loss_fn, (step.tx, step.mesh, options)
        self.error: Exception | None = None
        self.step: WholeMeshStep | None = None

    def loss(self, *args: Any, **kwargs: Any) -> Any:
        """``loss_fn``, recording what it raises."""
        try:
            return self.loss_fn(*args, **kwargs)
        except REFUSED as error:  # (jax's, not another error of the loss)
            if any(m in str(error) for m in ("of type Auto or Manual", "from `Manual`")):
                self.error = error
            raise

    def run(self, per_device: Callable[[], Any], lower: bool, *args: Any) -> Any:
        """``per_device()`` (the step, or its lowering), or the whole-mesh step's on
        ``args`` (state, batch, key) once the loss raised there."""
        if self.step is None:
            try:
                return per_device()
            except REFUSED as error:  # (raised while tracing: nothing donated)
                if error is not self.error:
                    raise
                self.step = whole_mesh_step(self.loss_fn, *self.args, error)
        return (self.step.lower if lower else self.step)(*args)


def whole_mesh_step(
    loss_fn: Callable[..., Any], tx: Any, mesh: Any, options: dict, error: Exception
) -> WholeMeshStep:
    """The :class:`WholeMeshStep` for a step of ``tx`` (at its config's stage) with
    ``options`` (``accum_steps``, ``has_aux``, ``donate``) whose loss raised ``error``
    per device.

    Raises:
      ValueError: ``error``, with a note naming the option this step cannot run so
        (``accum_steps``, ``deterministic=``, ``quantize_grads``, at stage 3
        ``quantize_weights``, a replica axis)
        and what to do instead.
    """
    config = optimizer_of(tx).config
    three = kept_apart(config.stage)[2]  # (the drop-in's stage 3 refuses quantized weights)
    try:  # (jax.grad reduces the gradients there: in its order, not quantized)
        config.check_in_jit(mesh, pieces=three)
        fixed = False
    except ValueError:
        fixed = True
    quantized = "quantize_grads or quantize_weights" if three else "quantize_grads"
    refused = {
        f"accum_steps={options['accum_steps']}": options["accum_steps"] > 1,
        f"deterministic, {quantized}": fixed,
        "replica_axis (or an axis_name not first among the mesh's axes)": not drop_in_is_step(
            tx, mesh
        ),
    }
    if any(refused.values()):
        error.add_note(
            "zeroshard: the loss's own sharding calls do not run per device in the step "
            "(they name the batch axis, pass a PartitionSpec to reshard, or leave it with "
            "auto_axes). The step runs "
            "such a loss on the whole mesh instead, but not with "
            f"{', '.join(k for k, v in refused.items() if v)}: leave it out, or train with "
            "zs.sharded(...) in your own jax.jit step."
        )
        raise error
    logger.info(
        "zeroshard: the loss does not run per device (%s); the step runs it on the whole "
        "mesh and updates as the drop-in does (its gradient all-reduced).",
        str(error).splitlines()[0],
    )
    return WholeMeshStep(loss_fn, tx, mesh, options)
