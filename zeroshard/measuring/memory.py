"""Planner: model-state bytes per device for each ZeRO stage, before running anything.

The ZeRO paper's accounting (Rajbhandari et al., 2020, section 3): with Ψ parameters
on N devices, mixed-precision Adam keeps 2Ψ bytes of fp16 parameters, 2Ψ of fp16
gradients and KΨ of optimizer state (K = 12: fp32 master, momentum and variance).
Baseline data parallelism holds (2 + 2 + K)Ψ per device; stage 1 shards the optimizer
state, (2 + 2)Ψ + KΨ/N; stage 2 the gradients too, 2Ψ + (2 + K)Ψ/N; stage 3 the
parameters as well, (2 + 2 + K)Ψ/N. Activations and temporaries are not counted.

zeroshard keeps a master copy only when the parameters are narrower than the master
dtype, so fp32 parameters have K = the moments alone.

:func:`estimate_memory` counts that model state. :func:`step_memory` is the planner of
the peak: it compiles zeroshard's step for the model's shapes (lowered on abstract
values, so nothing is allocated) and reads what the program holds per device, its
temporaries (gradients, gathered layers, activations) included: the figure the run
itself has, not an estimate of it.

Example:
    >>> est = estimate_memory(7.5e9, 64, stage=1)
    >>> round(est.total / 1e9, 1)   # the paper's 31.4 GB
    31.4
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import axes_of, mesh_size
from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import own_layout, sharding_of
from zeroshard.core.state_layout import state_devices_on, state_layout
from zeroshard.optimizer.config import check_mesh_axes, kept_apart
from zeroshard.optimizer.sharded import ShardedTransformation, sharded
from zeroshard.training.step import init_train_state, make_train_step

# Per-parameter fp32 buffers each optimizer keeps (beyond the master weights).
MOMENTS = {"sgd": 0, "momentum": 1, "lion": 1, "adagrad": 1, "rmsprop": 1, "adam": 2, "adamw": 2}
STAGES = ("0 (data parallel)", "1 (optimizer state)", "2 (+ gradients)", "3 (+ parameters)")


class MemoryEstimate(NamedTuple):
    """Model-state bytes per device, by component (activations not included).

    Attributes:
      params: weights in the compute dtype.
      grads: gradients in the compute dtype (the full-size buffer a step holds).
      optimizer_state: the optimizer's per-parameter buffers.
      master: fp32 master weights (0 when the parameters are fp32 already).
      imbalance: the optimizer state and master each device allocates over the mean
        of what devices use (1.0 when every leaf is sliced). Leaves whose update
        needs the whole tensor are owned by one device each; every device allocates
        rows as long as the most loaded one's, which ``optimizer_state`` counts.
      update_imbalance: the same for the update's compute (whole-tensor work, e.g.
        Newton-Schulz at ``m * n * min(m, n)`` per matrix); 1.0 without owned leaves.
    """

    params: float
    grads: float
    optimizer_state: float
    master: float
    imbalance: float = 1.0
    update_imbalance: float = 1.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_state + self.master


def param_count(params_or_count: PyTree | float) -> float:
    """The number of parameters in a tree of arrays or ``ShapeDtypeStruct`` (or the count
    itself)."""
    if isinstance(params_or_count, (int, float)):
        return float(params_or_count)
    return float(sum(np.prod(x.shape) for x in jax.tree.leaves(params_or_count)))


def _nbytes(x: Any) -> float:
    return float(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _inner(optimizer: Any) -> Any:
    """The optax transformation ``zs.sharded(inner)`` wraps (others as they are)."""
    return optimizer.inner if isinstance(optimizer, ShardedTransformation) else optimizer


def _structs(params: PyTree, dtype: Any) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)


def _plan(params: PyTree, n: int, optimizer: Any, param_dtype: Any, master_dtype: Any):
    """``(tx, plan)``: ``optimizer`` as :func:`zeroshard.sharded` (wrapped unless it is
    one) and its plan for ``params`` in ``param_dtype`` over ``n`` devices (of its
    ``axis_name``)."""
    if not isinstance(optimizer, ShardedTransformation):
        optimizer = sharded(optimizer, master_dtype=master_dtype)
    axes = optimizer.config.axes
    mesh = jax.sharding.AbstractMesh((n, *[1] * (len(axes) - 1)), axes)
    built = state_layout(optimizer, mesh, _structs(params, param_dtype))
    return built.tx, built.plan


def _optimizer_bytes(optimizer: Any) -> float:
    """Bytes of optimizer state per parameter."""
    if isinstance(optimizer, str):
        if optimizer not in MOMENTS:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; one of {sorted(MOMENTS)}, "
                "a number of fp32 buffers per parameter, or an optax transform."
            )
        return 4.0 * MOMENTS[optimizer]
    if isinstance(optimizer, (int, float)):
        return 4.0 * optimizer
    probe = {"p": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    state = jax.eval_shape(_inner(optimizer).init, probe)
    return sum(jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state) if x.shape == (4096,))


def estimate_memory(
    params_or_count: PyTree | float,
    num_devices: int | Mapping[str, int],
    *,
    stage: int = 1,
    param_dtype: Any = jnp.bfloat16,
    master_dtype: Any = jnp.float32,
    optimizer: Any = "adam",
    param_specs: PyTree | None = None,
) -> MemoryEstimate:
    """Model-state bytes per device for a ZeRO stage.

    Args:
      params_or_count: the parameter tree (arrays or ``ShapeDtypeStruct``) or a count.
      num_devices: devices the state is sharded over (N); or the mesh's shape, a
        mapping of axis names to sizes (``{"data": 4, "model": 2}``), to count what
        zeroshard's step keeps there: the batch split over the optimizer's
        ``axis_name`` (``"data"`` unless ``optimizer`` is a ``zs.sharded``
        transformation), and the state, stage 2's gradients and stage 3's weights
        over every axis but the replica axis
        (:meth:`zeroshard.optimizer.sharded.Sharded.for_step`; the one-line drop-in splits its
        state so too).
      stage: 0 (plain data parallelism), 1, 2 or 3.
      param_dtype: the compute dtype of parameters and gradients.
      master_dtype: the master weights' dtype (``None``: no master).
      optimizer: a name (``"adam"``, ``"sgd"``, ...), a number of fp32 buffers per
        parameter, or an optax transformation (measured with ``jax.eval_shape``; with
        a parameter tree and stage >= 1, laid out as :func:`zeroshard.sharded` would,
        owned leaves and their imbalance included). Pass ``zs.sharded(inner, ...)``
        itself to plan with its options (``stacked`` layers, ``placement``,
        ``master_dtype``; then ``master_dtype`` here is not used).
      param_specs: with a parameter tree and a mesh shape, each parameter's
        ``PartitionSpec`` on that mesh (a tree like the parameters; default: the specs
        of the leaves' own ``NamedSharding``, where they have one): below stage 3
        the weights are counted as laid out over the axes the batch is not split
        over (tensor parallelism's ``"model"``: zeroshard's step keeps that layout),
        and at stage 0 over every axis they name.

    Returns:
      A :class:`MemoryEstimate` in bytes (floats: counts may be fractional per device).
    """
    state_apart, grads_apart, params_apart = kept_apart(stage)
    n = state_devices(num_devices, optimizer)
    psi = param_count(params_or_count)
    p = jnp.dtype(param_dtype).itemsize
    has_master = master_dtype is not None and p < jnp.dtype(master_dtype).itemsize
    m = jnp.dtype(master_dtype).itemsize if has_master else 0
    shard = lambda per_param, apart: psi * per_param / (n if apart else 1)
    params = shard(p, params_apart)
    if isinstance(num_devices, Mapping) and not isinstance(params_or_count, (int, float)):
        params = _laid_out_bytes(params_or_count, p, num_devices, stage, optimizer, param_specs)
    if hasattr(optimizer, "init") and not isinstance(params_or_count, (int, float)):
        if state_apart:
            placed = _placed(params_or_count, n, param_dtype, master_dtype, optimizer)
            return placed._replace(params=params, grads=shard(p, grads_apart))
        # stage 0: plain optax's state, on every device
        dtype = master_dtype if has_master else param_dtype
        state = jax.eval_shape(_inner(optimizer).init, _structs(params_or_count, dtype))
        o = sum(_nbytes(x) for x in jax.tree.leaves(state))
    else:
        o = shard(_optimizer_bytes(optimizer), state_apart)
    return MemoryEstimate(params, shard(p, grads_apart), o, shard(m, state_apart))


def _laid_out_bytes(
    params: PyTree, itemsize: int, shape: Mapping[str, int], stage: int, tx: Any, specs: Any
) -> float:
    """The weights' bytes per device on a mesh of ``shape`` as ``specs`` lay them out
    (default: the leaves' own layouts): stage 3's pieces over the state's axes; below,
    each leaf divided over the axes of its spec the batch is not split over (at stage
    0, plain data parallelism, over all of them)."""
    tx = tx if isinstance(tx, ShardedTransformation) else sharded(optax.identity())
    state_apart, _, params_apart = kept_apart(stage)
    if params_apart:
        return param_count(params) * itemsize / state_devices(shape, tx)
    specs = own_layout(params, shape) if specs is None else specs
    batch = tx.config.batch_axes if state_apart else ()
    split = lambda spec: math.prod(
        shape[a] for e in spec if e is not None for a in axes_of(e) if a not in batch
    )
    leaves = jax.tree.leaves(params)
    sizes = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(
        float(np.prod(x.shape)) * itemsize / split(s) for x, s in zip(leaves, sizes, strict=True)
    )


def state_devices(num_devices: int | Mapping[str, int], optimizer: Any = None) -> int:
    """The devices the state is split over for :func:`estimate_memory`'s
    ``num_devices`` (a count: itself; a mesh shape: as zeroshard's step lays the state
    out on it, every axis but the replica axis of ``optimizer``).

    Raises:
      ValueError: for a count below one, or a mesh shape without the axes.
    """
    if not isinstance(num_devices, Mapping):
        if num_devices < 1:
            raise ValueError(f"num_devices must be positive, got {num_devices!r}.")
        return num_devices
    tx = optimizer if isinstance(optimizer, ShardedTransformation) else sharded(optax.identity())
    mesh = jax.sharding.AbstractMesh(tuple(num_devices.values()), tuple(num_devices))
    check_mesh_axes(mesh, tx.axis_name, tx.config.replica_axis)
    return state_devices_on(tx, mesh)


class StepMemory(NamedTuple):
    """What a compiled step holds on each device (``compiled.memory_analysis()``,
    per device for an SPMD program), in bytes.

    Attributes:
      arguments: the state and the batch the step reads.
      outputs: what it returns (the new state, the metrics).
      temporaries: what it makes and frees inside (gradients, gathered weights,
        activations, collective buffers).
      aliased: outputs written into donated arguments (counted once).
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int

    @property
    def peak(self) -> int:
        """The most the step holds at once (arguments, outputs and temporaries, less
        the aliased outputs)."""
        return self.arguments + self.outputs + self.temporaries - self.aliased


def step_memory(
    loss_fn: Any,
    tx: ShardedTransformation,
    mesh: jax.sharding.Mesh,
    params: PyTree,
    batch: PyTree,
    *,
    stage: int = 1,
    param_dtype: Any = None,
    accum_steps: int = 1,
    has_aux: bool = False,
    own_step: bool = False,
) -> StepMemory:
    """The per-device memory of :func:`zeroshard.make_train_step`'s step, before any run.

    The step is built as the run builds it, lowered on abstract values (the state of
    :func:`zeroshard.init_train_state` traced with ``jax.eval_shape``, the batch as
    ``jax.ShapeDtypeStruct``) and compiled, so nothing is allocated and the figures are
    those of the program that will run (for this jax, backend and mesh).

    Args:
      loss_fn: the loss, as :func:`zeroshard.make_train_step` takes it.
      tx: the optimizer from :func:`zeroshard.sharded`.
      mesh: the mesh to plan for.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      batch: the global batch (arrays or ``jax.ShapeDtypeStruct``).
      stage: the ZeRO stage (1, 2 or 3).
      param_dtype: the compute dtype of the parameters (``None``: theirs).
      accum_steps: micro-batches per step.
      has_aux: whether ``loss_fn`` returns aux.
      own_step: ``loss_fn`` is your own step instead, ``step(params, opt_state,
        batch)`` calling ``tx.update`` (the one-line drop-in, at the stage of
        ``zs.sharded(..., stage=)``), plain or jitted (a plain one is jitted with
        the parameters and the state donated): its peak, the parameters laid out as
        ``tx.shard_params`` lays them (stage 1: as given), the state as ``tx.init``,
        the batch split over the batch axes where it has no layout.

    Returns:
      A :class:`StepMemory`; ``.peak`` is the most a device holds during the step.

    Raises:
      ValueError: with ``own_step``, for ``stage``, ``accum_steps`` or ``has_aux``
        (zeroshard's step's options; your step's stage is its optimizer's).

    Example:
      >>> import jax, jax.numpy as jnp, optax, zeroshard as zs
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
      >>> batch = {"x": jax.ShapeDtypeStruct((16, 1024), jnp.float32)}
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
      >>> memory = zs.step_memory(loss, zs.sharded(optax.adam(1e-3)), mesh, params, batch)
      >>> weights = 4 * 1024 * 1024  # (replicated; the moments 1/N each)
      >>> weights < memory.arguments < weights * (1 + 2 / jax.device_count()) + 2**17
      True
      >>> memory.peak >= memory.arguments
      True
    """
    options = dict(stage=stage, accum_steps=accum_steps, has_aux=has_aux)
    if own_step:
        return _own_step_memory(loss_fn, tx, mesh, params, batch, param_dtype, options)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    step = make_train_step(loss_fn, tx, mesh, **options)
    own = own_layout(params, mesh.axis_names)  # (read here: what eval_shape traces has none)
    init = lambda p: init_train_state(
        p, tx, mesh, param_dtype=param_dtype, stage=stage, param_specs=own
    )
    shapes = jax.eval_shape(init, structs)
    # Laid out as the step takes it (on Auto axes the shapes carry no layout).
    on_mesh = lambda spec, tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree
    )
    specs = step.layout_for(shapes.params, step.static_layout(own)).returned(step.route.departure)
    state = jax.tree.map(on_mesh, specs, shapes, is_leaf=lambda x: isinstance(x, P))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    return _memory_of(step.lower(state, abstract))


def _own_step_memory(
    step: Any, tx: Any, mesh: Any, params: PyTree, batch: PyTree, dtype: Any, options: dict
) -> StepMemory:
    """:func:`step_memory` of the user's own step (``own_step``)."""
    if options != dict(stage=1, accum_steps=1, has_aux=False):
        raise ValueError(
            "zs.step_memory(step, ..., own_step=True) compiles your step as it is: stage=, "
            "accum_steps= and has_aux= are zeroshard's step's options (your step's stage "
            "is its optimizer's, zs.sharded(inner, stage=)). Leave them out."
        )
    own = lambda x: x if isinstance(x, NamedSharding) else None
    laid = lambda x, spec, dtype=None: jax.ShapeDtypeStruct(
        x.shape,
        dtype or x.dtype,
        sharding=own(sharding_of(x)) or NamedSharding(mesh, spec),
    )  # (its own layout on a mesh, else ``spec``)
    params = jax.tree.map(lambda x: laid(x, P(), dtype), params)
    batch = jax.tree.map(lambda x: laid(x, P(tx.config.batch_axes)), batch)
    drop_in = tx.spanning(mesh)  # (its state over every axis of the mesh)
    with jax.set_mesh(mesh):
        params = tx.shard_params(params) if kept_apart(tx.config.stage)[1] else params
        splits = drop_in.optimizer.typed_splits(mesh, params)
        specs = drop_in.state_specs(params, mesh_size(mesh, drop_in.axis_name), splits)
        on = lambda x, spec: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
        )
        state = jax.tree.map(on, jax.eval_shape(tx.init, params), specs)
        step = step if hasattr(step, "lower") else jax.jit(step, donate_argnums=(0, 1))
        return _memory_of(step.lower(params, state, batch))


def _memory_of(lowered: Any) -> StepMemory:
    stats = lowered.compile().memory_analysis()
    return StepMemory(
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.temp_size_in_bytes,
        stats.alias_size_in_bytes,
    )


def _placed(params: PyTree, n: int, param_dtype: Any, master_dtype: Any, optimizer: Any):
    """Optimizer state and master bytes per device as :func:`zeroshard.sharded` lays
    them out (params and grads left to the caller)."""
    tx, plan = _plan(params, n, optimizer, param_dtype, master_dtype)
    view = plan.state_treedef.flatten_up_to(jax.eval_shape(tx.inner.init, plan.view_structs(0)))
    # (a coded leaf: its codes and block scales, zeroshard.core.lowbit)
    held = lambda kind, x: kind.coding.nbytes(x.size) if kind.coding else _nbytes(x)
    kinds = zip(plan.state_kinds, view, strict=True)
    shared = sum(kind.per_device(held(kind, x), n) for kind, x in kinds)
    masters = zip(plan.layout.buckets, plan.master_dtypes, strict=True)
    master = sum(b.row_size * jnp.dtype(m).itemsize for b, m in masters if m is not None)
    widths = zip(plan.storage.widths, plan.storage.dtypes, strict=True)
    rows = sum(w * d.itemsize for w, d in widths)
    used = shared + master + sum(plan.owned_bytes()) / n
    costs = plan.owned_costs()
    imbalance = (shared + rows + master) / used if used else 1.0
    update_imbalance = max(costs) / (sum(costs) / n) if sum(costs) else 1.0
    return MemoryEstimate(0.0, 0.0, shared + rows, master, imbalance, update_imbalance)


def placement_table(params: PyTree, num_devices: int, optimizer: Any, param_dtype: Any) -> str:
    """Where :func:`zeroshard.sharded` puts each leaf of ``params`` and the load per
    device: leaves by placement, then per device the owned units (whole leaves and
    layers), their state and master bytes and their update cost, and the imbalance
    of each (most loaded device over the mean)."""
    _, plan = _plan(params, num_devices, optimizer, param_dtype, jnp.float32)
    slots = plan.layout.slots
    kinds = Counter(s.placement for s in slots)
    lines = ["leaves: " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))]
    if not any(s.owned for s in slots):
        return "\n".join(lines)
    nbytes, costs = plan.owned_bytes(), plan.owned_costs()
    lines += ["", "| device | owned units | owned bytes | update cost |", "|---:|---|---:|---:|"]
    layers = lambda k: f"{k} layer" + "s" * (k != 1)
    for d in range(num_devices):
        units = [
            f"{s.path}[{layers(len(s.units_of(d)))}]" if s.layered else s.path
            for s in slots
            if d in s.owners
        ]
        shown = ", ".join(units[:3]) + (f" (+{len(units) - 3})" if len(units) > 3 else "")
        lines.append(f"| {d} | {shown or '-'} | {nbytes[d]:,} | {costs[d]:.3g} |")
    mean = lambda x: sum(x) / len(x)
    lines.append(
        f"\nimbalance (max/mean): owned bytes {max(nbytes) / mean(nbytes):.2f}, "
        f"update cost {max(costs) / mean(costs):.2f}"
    )
    return "\n".join(lines)


def plan_table(count: float | PyTree, num_devices: int, **kwargs: Any) -> str:
    """A markdown table of :func:`estimate_memory` for stages 0-3 (GB = 10^9 bytes)."""
    rows = [
        "| stage | params | grads | optimizer state | master | total |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for stage, name in enumerate(STAGES):
        e = estimate_memory(count, num_devices, stage=stage, **kwargs)
        cells = [e.params, e.grads, e.optimizer_state, e.master, e.total]
        rows.append(f"| {name} | " + " | ".join(f"{c / 1e9:.2f} GB" for c in cells) + " |")
    return "\n".join(rows)
