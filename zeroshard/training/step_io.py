"""Step I/O: what a data-parallel step reads and returns besides the sharded state.

Every step (:func:`zeroshard.make_train_step`, the Flax steps) runs inside
``shard_map`` over the batch axes, where each device sees its own rows. These helpers
make what crosses the step's boundary mean what it means on one device:

- a random key becomes a distinct, reproducible stream per device (dropout masks
  differ across devices; the same key gives bit-identical runs);
- the loss is the global mean, scalar aux is averaged, and aux with a leading batch
  dimension comes back as the global per-example array, in batch order;
- non-trainable model state (BatchNorm statistics, ...) is averaged over the batch
  axes, so it is identical on every device;
- the metrics report what the sharded update did: the gradient norm, whether the
  step was skipped (a non-finite gradient) and the loss scale it used;
- what a step returns is typed as a plain ``jax.jit``'s outputs are inside
  ``jax.set_mesh`` (on the context mesh's axis types), and outside any mesh context on
  the mesh's Auto twin, so it mixes with single-device code there
  (``nnx.MultiMetric.reset()``, an eval step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from zeroshard.communication.collectives import is_identity
from zeroshard.core.layout import PyTree, is_floating
from zeroshard.core.mesh import sharding_of
from zeroshard.measuring.scopes import METRICS, MODEL_STATE, scope

if TYPE_CHECKING:
    from zeroshard.optimizer.config import ShardConfig

Axes = str | tuple[str, ...]


def device_key(key: jax.Array | None, axes: Axes) -> jax.Array | None:
    """``key`` folded with this device's index over ``axes`` (``None`` stays ``None``)."""
    return None if key is None else jax.random.fold_in(key, jax.lax.axis_index(axes))


def pmean(x: Any, axes: Axes) -> Any:
    """``jax.lax.pmean``, left out where it is the identity (one device, see
    :func:`zeroshard.communication.collectives.is_identity`)."""
    return x if is_identity(x, axes) else jax.lax.pmean(x, axes)


def mean_state(tree: PyTree, axes: Axes) -> PyTree:
    """Floating-point leaves of ``tree`` averaged over ``axes``; other leaves as they are."""

    with scope(MODEL_STATE):
        return jax.tree.map(lambda x: pmean(x, axes) if is_floating(x) else x, tree)


def is_per_example(x: Any, rows: int) -> bool:
    """Whether an aux leaf has one entry per example of a ``rows``-row local batch."""
    return jnp.ndim(x) >= 1 and jnp.shape(x)[0] == rows


def global_aux(aux: PyTree, rows: int, axes: Axes) -> PyTree:
    """Per-example aux leaves (leading dimension ``rows``, the local batch) gathered into
    the global batch, in its order; other leaves averaged over ``axes``."""

    def combine(x: Any) -> Any:
        if is_per_example(x, rows) and not is_identity(x, axes):
            return jax.lax.all_gather(x, axes, tiled=True, to="invarying")
        return pmean(x, axes)

    return jax.tree.map(combine, aux)


def stacked_aux(x: jax.Array, rows: int) -> jax.Array:
    """An aux leaf stacked over a leading axis (micro-batches): per-example leaves
    (``rows`` per entry) concatenated in batch order, other leaves averaged over the
    stack."""
    if jnp.ndim(x) >= 2 and is_per_example(x[0], rows):
        return x.reshape(x.shape[0] * rows, *x.shape[2:])
    return jnp.mean(x.astype(jnp.float32), axis=0)


def step_metrics(
    config: ShardConfig,
    loss: jax.Array,
    aux: Any,
    batch: PyTree,
    axes: Axes,
    states: tuple,
    reduced: bool = False,
) -> dict:
    """A step's metrics: :func:`loss_metrics` and :func:`update_metrics` together."""
    return update_metrics(config, states, loss_metrics(loss, aux, batch, axes, reduced))


def loss_metrics(loss: jax.Array, aux: Any, batch: PyTree, axes: Axes, reduced: bool) -> dict:
    """The global mean ``loss`` and ``aux`` (when there is one) as :func:`global_aux`
    returns it for this device's ``batch`` (with ``reduced``, both are global already)."""
    with scope(METRICS):
        metrics = {"loss": loss.astype(jnp.float32)}
        if not reduced:
            metrics["loss"] = pmean(metrics["loss"], axes)
        if aux is not None:
            metrics["aux"] = aux if reduced else global_aux(aux, local_rows(batch), axes)
    return metrics


def update_metrics(config: ShardConfig, states: tuple, metrics: dict) -> dict:
    """``metrics`` (:func:`loss_metrics`) with the gradient norm and what the sharded
    update did, from its optimizer state before and after it (``states``; ``config``:
    the optimizer's options). Every value but ``aux`` is a replicated scalar, the same
    on every device:

    - ``"skipped"`` (when ``config.skip_nonfinite``, the default): int32, 1 when this
      step's update was skipped because the mean gradient was not finite (the
      weights and state stayed as they were), else 0. Its sum over steps is
      ``opt_state.skipped``, the running count; its mean, the fraction skipped.
    - ``"loss_scale"`` (when ``config.loss_scale`` is set): float32, the scale this
      step's loss was multiplied by. After a skipped step the next step's is smaller;
      after ``growth_interval`` finite steps, larger.
    """
    before, after = states
    metrics = {"loss": metrics["loss"], "grad_norm": after.grad_norm, **metrics}
    if config.skip_nonfinite:
        metrics["skipped"] = after.skipped - before.skipped
    if config.loss_scale is not None:
        metrics["loss_scale"] = before.loss_scale.scale
    return metrics


def local_rows(batch: PyTree) -> int:
    """The number of rows of this device's batch (its leaves' leading dimension)."""
    return jnp.shape(jax.tree.leaves(batch)[0])[0]


def placed(batch: PyTree, rows: NamedSharding) -> PyTree:
    """``batch`` placed on ``rows``; abstract values (``jax.ShapeDtypeStruct``, to lower
    a step without data) given that sharding, not placed."""
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), batch)
    return jax.device_put(batch, rows)


def step_loss(loss_fn: Callable[..., Any], has_aux: bool, scale: Any) -> Callable[..., Any]:
    """A user's loss in the step's convention: ``loss(params, batch, key, model_state)
    -> (loss, (aux, new_model_state))``, the loss times ``scale.scale`` when there is a
    loss scale (dynamic loss scaling differentiates the scaled loss).

    ``loss_fn(params, batch)`` gets ``key=`` when the step was given a key and
    ``model_state=`` when the state carries one. With a model state it returns
    ``(loss, new_model_state)``, or ``(loss, (new_model_state, aux))`` with
    ``has_aux`` (Flax's ``mutable=`` convention); otherwise ``loss`` or ``(loss, aux)``.
    """

    def loss(params, batch, key, model_state):
        extras = {"key": key, "model_state": model_state}
        out = loss_fn(params, batch, **{k: v for k, v in extras.items() if v is not None})
        value, rest = out if has_aux or model_state is not None else (out, None)
        if scale is not None:
            value = value.astype(jnp.float32) * scale.scale
        if model_state is None:
            return value, (rest, None)
        new_state, aux = rest if has_aux else (rest, None)
        return value, (aux, new_state)

    return loss


def split_rows(tree: PyTree, k: int) -> PyTree:
    """Every leaf of ``tree`` with its leading dimension split into ``(k, rows / k)``."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), tree)


def output_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The twin of ``mesh`` (the same devices and layouts) a step's outputs are typed
    on here: inside ``jax.set_mesh``, with the context mesh's axis types (as a plain
    ``jax.jit``'s outputs are typed there); outside any mesh context, all ``Auto`` (an
    Explicit type there makes single-device code, e.g. ``nnx.MultiMetric.reset()``,
    raise)."""
    context = jax.sharding.get_abstract_mesh()
    same = not context.empty and tuple(context.axis_names) == tuple(mesh.axis_names)
    types = context.axis_types if same else (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def plain_outputs(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """A step's outputs (``tree``, laid out on ``mesh``) typed on :func:`output_mesh`:
    the same devices and layouts, no copies."""
    target = output_mesh(mesh)

    def retype(x: Any) -> Any:
        sharding = sharding_of(x)
        if not isinstance(sharding, NamedSharding) or sharding.mesh == target:
            return x
        return jax.device_put(x, NamedSharding(target, sharding.spec))

    return jax.tree.map(retype, tree)
