"""The step on the whole mesh, for a loss whose own sharding calls cannot run per device.

zeroshard's steps run the loss with the batch axis manual. A model written for jax's
Explicit meshes may name that axis in its own
sharding calls (``jnp.dot(h, w, out_sharding=P("data", None))``) or pass a
``PartitionSpec`` to ``reshard``, which jax refuses there ("... cannot contain axis
names that are of type Auto or Manual"). Such a loss trains under the user's own
``jax.jit`` on the mesh, and so it does here: :func:`whole_mesh_step` runs it on the
global batch under ``jax.jit`` on the mesh as given (the compiler reduces the
gradient), then the sharded update of the mean gradient
(:func:`zeroshard.communication.jit_pieces.apply_in_jit`, the one-line drop-in's) on the
state as the step laid it out. At stage 3 the step's pieces are the drop-in's weights: the
loss's ``zs.gather`` / ``zs.layer`` gather them as in the user's own ``jax.jit``, and
the drop-in's stage-3 update keeps them pieces. The steps fall back
to it when the loss raises per device, so the same loss works with no option to set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.jit_pieces import apply_in_jit
from zeroshard.core.layout import PyTree
from zeroshard.core.state_layout import drop_in_is_step, state_layout
from zeroshard.optimizer.config import kept_apart
from zeroshard.optimizer.sharded import optimizer_of
from zeroshard.optimizer.state import TrainState, key_of
from zeroshard.training.gradient import REFUSED, Refusals, check_whole_mesh, on_whole_mesh
from zeroshard.training.step_io import placed, step_metrics


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
        value_and_grad = on_whole_mesh(self.loss_fn, self.has_aux, scale, self.opt.config)
        (loss, (aux, model_state)), grads = value_and_grad(
            state.params, batch, key, state.model_state
        )
        loss = loss if scale is None else loss / scale.scale
        if self.pieces:  # (the drop-in's update of its weights, as pieces again)
            made = key_of(state.opt_state)  # (the drop-in's state's, then the step's again)
            opt_state = state.opt_state._replace(layout=dataclasses.replace(made, pieces=False))
            params, opt_state = apply_in_jit(self.three, grads, opt_state, state.params, {})
            opt_state = opt_state._replace(layout=made)
        else:  # (the state kept as zeroshard's step keeps it)
            params, opt_state = apply_in_jit(
                self.opt, grads, state.opt_state, state.params, {}, dict(splits)
            )
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


class Fallback:
    """The loss of ``step`` (a :class:`zeroshard.training.step.TrainStep`), recording jax's
    refusal per device (:class:`zeroshard.training.gradient.Refusals`), and the
    :class:`WholeMeshStep` the step falls back to once it has raised it."""

    def __init__(self, step: Any):
        options = {k: getattr(step, k) for k in ("accum_steps", "has_aux", "donate")}
        self.refusals, self.args = Refusals(step.loss_fn), (step.tx, step.mesh, options)
        self.step: WholeMeshStep | None = None

    def run(self, per_device: Callable[[], Any], lower: bool, *args: Any) -> Any:
        """``per_device()`` (the step, or its lowering), or the whole-mesh step's on
        ``args`` (state, batch, key) once the loss raised there."""
        if self.step is None:
            try:
                return per_device()
            except REFUSED as error:  # (raised while tracing: nothing donated)
                if error is not self.refusals.error:
                    raise
                self.step = whole_mesh_step(self.refusals.loss_fn, *self.args, error)
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
        ``quantize_weights``; an ``axis_name`` not first among the mesh's, where the
        step's state is laid out otherwise than the drop-in's) and what to do instead.
    """
    same = drop_in_is_step(tx, mesh)
    check_whole_mesh(optimizer_of(tx), mesh, options["accum_steps"], error, "The step", same)
    return WholeMeshStep(loss_fn, tx, mesh, options)
