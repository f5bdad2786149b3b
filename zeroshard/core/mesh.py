"""Mesh: which mesh a state or an update is on, whether it has the optimizer's axes,
and running a per-device function on it.

The data-parallel axis is said once, in :func:`zeroshard.sharded` (``axis_name``): the
entry points that take ``axis_name=`` again accept only the optimizer's
(:func:`check_mesh`). The mesh is the one given, else the optimizer's ``mesh=``, else
the one set with ``jax.set_mesh``, else the one the arrays are laid out on
(:func:`find_mesh`). While a step traces the user's loss, its axis is the one
:func:`zeroshard.gather` and :func:`zeroshard.layer` gather over when not told
(:func:`in_step`, :func:`axis_of_step`).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.communication.collectives import axes_of
from zeroshard.core.layout import PyTree
from zeroshard.optimizer.config import ShardConfig, check_mesh_axes


def check_mesh(config: ShardConfig, mesh: jax.sharding.Mesh, axis_name: str | None) -> str:
    """The data-parallel axis: the optimizer's (said once, in ``zs.sharded``);
    ``axis_name``, the keyword the public entry points still accept, may only repeat
    it. Refuses a mesh without the optimizer's axes, naming the fix."""
    if axis_name not in (None, config.axis_name):
        raise ValueError(
            f"the optimizer was built with axis_name={config.axis_name!r} but the step uses "
            f"axis_name={axis_name!r}; use the same axis for both."
        )
    check_mesh_axes(mesh, config.axis_name, config.replica_axis)
    return config.axis_name


def find_mesh(
    config: ShardConfig,
    tree: PyTree = None,
    mesh: Any = None,
    *,
    context: bool = True,
    any_axes: bool = False,
) -> Any:
    """``mesh``, else ``config.mesh``, else (with ``context``) the mesh set with
    ``jax.set_mesh``, else the mesh the arrays of ``tree`` are laid out on: the first
    with ``config.axis_name`` (with ``any_axes``, the first at all: the one-line
    drop-in spreads its state over every axis of whatever mesh it is on).

    Raises:
      ValueError: if none is known, or (with ``context``) the mesh found differs
        from the one set with ``jax.set_mesh``, naming the fixes.
    """
    axis = config.axis_name
    wanted = set() if any_axes else set(config.axes)
    has_axes = lambda m: not m.empty and wanted <= set(m.axis_names)
    current = jax.sharding.get_abstract_mesh()
    if mesh is not None or config.mesh is not None:
        return _agreed(config.mesh if mesh is None else mesh, current, context, "mesh=", axis)
    if context and has_axes(current):
        return current
    for leaf in jax.tree.leaves(tree):
        sharding = sharding_of(leaf)
        if not isinstance(sharding, NamedSharding):  # a tracer: its type's sharding
            sharding = getattr(jax.typeof(leaf), "sharding", None)
        found = getattr(sharding, "mesh", None)
        if found is not None and has_axes(found):
            return _agreed(found, current, context, "the arrays' layout", axis)
    if not context:
        raise ValueError(
            f"no mesh with axis {axis!r} is known for this state: pass mesh=..., or build "
            "the optimizer with zs.sharded(inner, mesh=mesh)."
        )
    raise ValueError(
        f"zeroshard: no mesh with axis {axis!r} is known here. Build the optimizer with "
        f"zs.sharded(inner, axis_name={axis!r}, mesh=mesh), or call under "
        "`with jax.set_mesh(mesh):`; inside jax.shard_map over the axis, the local "
        f"update runs. (Mesh set now: {tuple(current.axis_names) or 'none'}.)"
    )


def _agreed(mesh: Any, current: Any, context: bool, source: str, axis: str) -> Any:
    """``mesh`` (from ``source``), refused where the mesh set with ``jax.set_mesh``
    differs from it (``shard_map`` would refuse the pair, from inside zeroshard)."""
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    if context and not current.empty and abstract != current:
        raise ValueError(
            f"zeroshard: this optimizer's mesh ({source}) is {_shape(abstract)}, but the "
            f"mesh set with jax.set_mesh is {_shape(current)}; its update runs on one mesh. "
            "Call it under `with jax.set_mesh(mesh):` with the optimizer's mesh, or give the "
            "optimizer the context's: zs.sharded(inner, mesh=mesh), or no mesh= at all "
            f"(the context's mesh is taken where it has the axis {axis!r})."
        )
    return mesh


def _shape(mesh: Any) -> str:
    """``mesh``'s axes, sizes and types, e.g. ``{'data': 8 (Auto)}``."""
    axes = zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True)
    return "{" + ", ".join(f"{n!r}: {k} ({str(t).rsplit('.', 1)[-1]})" for n, k, t in axes) + "}"


def mesh_of(state: Any) -> jax.sharding.Mesh:
    """The mesh a :class:`zeroshard.TrainState` is laid out on."""
    sharding = getattr(state.step, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            "expected a zs.TrainState laid out on a mesh (from zs.init_train_state or a "
            f"train step); its step has sharding {sharding!r}."
        )
    return sharding.mesh


def bound_axis_size(axis_name: str) -> int | None:
    """Size of ``axis_name`` if it is bound here (inside ``shard_map``), else ``None``."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        return None


class StepContext(NamedTuple):
    """The zeroshard step being traced (:func:`in_step`).

    Attributes:
      axis_name: the axis :func:`zeroshard.gather` and :func:`zeroshard.layer` gather
        over when not told.
      gather: how they gather (:attr:`zeroshard.core.update.Route.gather`); ``None``
        where the step runs the loss on the whole mesh under ``jax.jit``
        (:mod:`zeroshard.training.whole_mesh`): as in the user's own ``jax.jit``.
      rest: the state's axes besides the batch's (tensor parallelism's ``"model"``,
        say), over which the pieces are cut too (:func:`zeroshard.gather`).
      replica_axis: the axis the state is copied over, if any.
    """

    axis_name: str
    gather: Callable[..., list] | None
    rest: tuple[str, ...] = ()
    replica_axis: str | None = None


_step: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("step", default=None)


@contextlib.contextmanager
def in_step(context: StepContext) -> Iterator[None]:
    """Inside: the step ``context`` says is being traced (per thread)."""
    token = _step.set(context)
    try:
        yield
    finally:
        _step.reset(token)


def current_step() -> StepContext | None:
    """The zeroshard step being traced here, if any (:func:`in_step`)."""
    return _step.get()


def axis_of_step(axis_name: str | None, caller: str) -> str:
    """``axis_name``, else the axis of the zeroshard step being traced, else the one
    manual axis of the user's own ``jax.shard_map`` (``caller``: the function asking,
    named in the error).

    Raises:
      ValueError: if ``axis_name`` is ``None`` outside any zeroshard step, and not in a
        ``shard_map`` with exactly one manual axis.
    """
    if axis_name is not None:
        return axis_name
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    step = _step.get()
    current = step.axis_name if step else manual[0] if len(manual) == 1 else None
    if current is None:
        raise ValueError(
            f"{caller} without axis_name= takes the axis of the zeroshard step it runs in "
            "(zs.make_train_step, the Flax steps), or of a jax.shard_map manual over one "
            f"axis; here it is {manual or 'neither'}. Name the axis the pieces are spread "
            f"over: {caller}(..., axis_name='data')."
        )
    return current


def on_mesh(
    local: Callable[..., Any],
    mesh: Any,
    axes: Collection[str],
    specs: tuple[Any, Any],
    check_vma: bool = True,
) -> Callable[..., Any]:
    """``local`` run on every device of ``mesh`` on its own part: a jitted
    ``shard_map`` manual over ``axes`` (``specs``: its ``(in_specs, out_specs)``).
    The programs that build or convert a state (``tx.init``, the own step's state,
    the checkpoint conversions, stage 3's pieces from their blocks) are each one."""
    in_specs, out_specs = specs
    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(axes),
            check_vma=check_vma,
        )
    )


def run_on_mesh(
    local: Callable[..., Any], mesh: Any, axis_name: str, specs: tuple[Any, Any], *args: Any
) -> Any:
    """:func:`on_mesh` (manual over ``axis_name``) on ``args`` placed as the
    ``in_specs`` say: how a state is first laid out, each device building its part."""
    named = lambda spec: NamedSharding(mesh, spec)
    placed = jax.device_put(args, jax.tree.map(named, specs[0], is_leaf=lambda x: isinstance(x, P)))
    return on_mesh(local, mesh, axes_of(axis_name), specs)(*placed)


def keep_axes(specs: PyTree, axes: Collection[str], leading: bool = False) -> PyTree:
    """``specs`` (a tree of ``PartitionSpec``) naming only the mesh axes in ``axes``:
    how a ``shard_map`` manual over ``axes`` sees arrays laid out as ``specs`` say (an
    outer one over the batch axes, a nested one over the others; those its type is
    ``reduced`` or ``unreduced`` over too). With ``leading``, of each dimension's axes
    only those before the first not in ``axes``."""

    def entry(e: Any) -> Any:
        named = axes_of(e) if e is not None else ()
        ours = itertools.takewhile if leading else filter
        kept = tuple(ours(lambda a: a in axes, named))
        return None if not kept else kept[0] if len(kept) == 1 else kept

    kept = lambda spec: dict(reduced=spec.reduced & {*axes}, unreduced=spec.unreduced & {*axes})
    keep = lambda spec: P(*map(entry, spec.partitions), **kept(spec))
    return jax.tree.map(keep, specs, is_leaf=lambda x: isinstance(x, P))


def own_layout(tree: PyTree, axes: Collection[str]) -> PyTree:
    """Each leaf's own layout over ``axes`` (a tensor-parallel ``"model"`` axis, say):
    its ``NamedSharding``'s ``PartitionSpec`` naming only those axes, ``P()`` where it
    has none (a NumPy array, or a leaf replicated over them). Hashable leaves: a step
    compiled for one layout is reused for the same."""
    return jax.tree.map(lambda x: keep_axes(x.sharding.spec, axes) if is_placed(x) else P(), tree)


def typed_layout(tree: PyTree, axes: Collection[str]) -> PyTree:
    """Each leaf's layout over ``axes``: a placed array's own (:func:`own_layout`),
    else as its type says (``jax.typeof``), which a traced array's does over Explicit
    mesh axes only: a ``PartitionSpec`` per leaf, naming only ``axes``, ``P()`` where
    neither says one. Of each dimension's axes, those before the first of another
    axis: a weight that stage 3 in the user's ``jax.jit`` cuts over the batch axes,
    minor to its own split (:func:`zeroshard.communication.jit_pieces.weight_spec`), reads as its
    own layout."""
    typed = lambda x: getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or P()
    spec = lambda x: x.sharding.spec if is_placed(x) else typed(x)
    return jax.tree.map(lambda x: keep_axes(spec(x), axes, leading=True), tree)


def is_placed(x: Any) -> bool:
    """Whether ``x`` is an array placed on a mesh (a ``NamedSharding``)."""
    return isinstance(sharding_of(x), NamedSharding)


def sharding_of(x: Any) -> Any:
    """``x``'s sharding, where it is an array placed on devices (else ``None``). A
    tracer has none, and asking it for one costs jax 0.10.2 a search of the whole
    trace so far for its error message: asked per leaf, the drop-in's 512-leaf step
    took 5.9 s to trace, not 1.3."""
    return None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)


def laid_out(tree: PyTree, specs: PyTree, mesh: Any = None) -> PyTree:
    """``tree`` laid out as ``specs`` (a tree of ``PartitionSpec`` on ``mesh``, default:
    the mesh in context) say: resharded on Explicit axes, constrained on Auto ones (the
    compiler then keeps each device's block only, where the value was whole)."""

    def put(x: Any, spec: P) -> Any:
        if not any(spec):  # (replicated over them: as it is)
            return x
        explicit = AxisType.Explicit in getattr(jax.typeof(x).sharding.mesh, "axis_types", ())
        to = spec if mesh is None else NamedSharding(mesh, spec)
        return jax.sharding.reshard(x, to) if explicit else jax.lax.with_sharding_constraint(x, to)

    return jax.tree.map(put, tree, specs)


def each_laid_out(tree: PyTree, specs: PyTree, mesh: Any = None) -> PyTree:
    """``tree`` resharded, on a mesh with Explicit axes, to ``specs`` (a
    ``PartitionSpec`` per leaf, on ``mesh`` or the mesh in context; see
    :func:`with_layout`)."""
    on = (lambda spec: spec) if mesh is None else (lambda spec: NamedSharding(mesh, spec))
    return jax.tree.map(lambda x, spec: with_layout(x, on(spec)), tree, specs)


def with_layout(tree: PyTree, like: Any) -> PyTree:
    """``tree`` resharded, over a mesh's Explicit axes, to ``like``'s layouts (a tree of
    arrays, or one ``NamedSharding`` for every leaf, or one ``PartitionSpec`` on the mesh
    in context); unchanged where the types carry no layout (over Auto axes the
    compiler places it)."""
    one = isinstance(like, NamedSharding | P)

    def put(x: Any, y: Any = None) -> Any:
        target = like if one else getattr(jax.typeof(y), "sharding", None)
        mesh = getattr(target, "mesh", None)
        own = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if not isinstance(target, P) and (mesh is None or mesh.empty):
            return x
        if own is None or own.empty:  # (on no mesh, one device: placed on the target's)
            own = jax.sharding.get_abstract_mesh() if mesh is None else mesh
        types = zip(getattr(own, "axis_names", ()), getattr(own, "axis_types", ()), strict=True)
        explicit = [a for a, t in types if t == AxisType.Explicit]
        if not explicit:
            return x
        if isinstance(target, P):
            return jax.sharding.reshard(x, keep_axes(target, explicit))
        return jax.sharding.reshard(x, NamedSharding(target.mesh, keep_axes(target.spec, explicit)))

    return jax.tree.map(put, tree) if one else jax.tree.map(put, tree, like)
