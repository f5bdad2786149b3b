"""Annotations: Flax's sharding metadata on the parameters, and the state's own.

Many programs compute every sharding of their training state from metadata: Linen's
``nn.with_logical_partitioning`` / ``nn.with_partitioning`` boxes
(``LogicallyPartitioned`` / ``Partitioned``) read by ``nn.get_partition_spec`` and
mapped by ``nn.logical_to_mesh_sharding(specs, mesh, rules)`` (t5x, MaxText, flax's
lm1b), or NNX's ``out_sharding`` metadata read by ``nnx.get_partition_spec``. Plain
optax's state copies the parameters' boxes onto its moments, which have the
parameters' shapes; zeroshard's pieces do not. So ``init`` takes the values out of
the boxes (:func:`unboxed`) and gives every state leaf a box of the same kind holding
its own layout (:func:`annotated`): each entry of its names is a tuple of mesh axes.
flax maps a logical name (a string) through the rules and passes any other entry
through unchanged (Linen's ``logical_to_mesh_axes``; NNX looks a name up as
``str(entry)``), and the tuple's axes count as taken, so no rule maps another of the
leaf's dimensions to them: the program's own rules reproduce zeroshard's layout,
with no rule of zeroshard's to add. (Flax is optional: only when it is imported can a
tree hold its boxes.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from zeroshard.core.layout import PyTree


def _kinds() -> tuple[type, ...]:
    """The box types of the Flax modules imported so far."""
    meta, nnx = sys.modules.get("flax.core.meta"), sys.modules.get("flax.nnx")
    return (*([meta.AxisMetadata] if meta else []), *([nnx.Variable] if nnx else []))


def _is_linen(box: Any) -> bool:
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(box, meta.AxisMetadata)


def _value(box: Any) -> Any:
    if not _is_linen(box):
        return box.get_raw_value()  # (an NNX Variable)
    # (a Partitioned box's value as it is: its unbox() would add a sharding constraint)
    return box.value if hasattr(box, "names") else box.unbox()


def unboxed(tree: PyTree) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """``tree`` with Flax's boxes (Linen ``AxisMetadata``, NNX ``Variable``) replaced
    by their values, and the function that puts a tree of such values back into the
    same boxes."""
    kinds = _kinds()
    is_box = lambda x: isinstance(x, kinds)
    if not any(map(is_box, jax.tree.leaves(tree, is_leaf=is_box))):
        return tree, lambda values: values

    def rebox(x: Any, v: Any) -> Any:
        if not is_box(x):
            return v
        return x.replace_boxed(v) if _is_linen(x) else x.replace(v)

    values = jax.tree.map(lambda x: _value(x) if is_box(x) else x, tree, is_leaf=is_box)
    return values, lambda new: jax.tree.map(rebox, tree, new, is_leaf=is_box)


def _names(spec: P, ndim: int) -> tuple:
    """``spec``'s entries, one per dimension, each a tuple of mesh axes or ``None``."""
    entries = (*spec, *(None,) * (ndim - len(spec)))
    return tuple(e if e is None or isinstance(e, tuple) else (e,) for e in entries)


def annotated(state: PyTree, specs: PyTree, params: PyTree) -> PyTree:
    """``state`` (arrays laid out as ``specs``, a ``PartitionSpec`` per leaf or
    subtree) with every array in a box of the first kind ``params`` holds, naming its
    layout; ``state`` as it is where ``params`` holds no boxes.

    A Linen box is the parameter's own, its ``names`` replaced: a
    ``LogicallyPartitioned`` stays one, so a program's
    ``unbox_logicallypartioned_trainstate`` unboxes it. An NNX one is a copy of the
    parameter's ``Variable`` with ``out_sharding`` (and any ``optimizer_sharding``,
    which ``nnx.Optimizer`` would take instead) set to it and ``eager_sharding`` off:
    it is laid out already, and ``nnx.Optimizer``'s copy of it would otherwise be
    sharded again, which needs a mesh set with ``jax.set_mesh``.
    """
    kinds = _kinds()
    boxes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, kinds)) if kinds else []
    fits = lambda x: isinstance(x, kinds) and hasattr(x, "names" if _is_linen(x) else "copy")
    template = next(filter(fits, boxes), None)
    if template is None:
        return state

    def box(x: Any, spec: P) -> Any:
        names = _names(spec, x.ndim)
        if _is_linen(template):
            return template.replace(value=x, names=names)
        keys = {"out_sharding"} | ({"optimizer_sharding"} & set(template.get_metadata()))
        return template.copy(x, **dict.fromkeys(keys, names), eager_sharding=False)

    each = lambda spec, sub: jax.tree.map(lambda x: box(x, spec), sub)
    return jax.tree.map(each, specs, state, is_leaf=lambda s: isinstance(s, P))


def check_layout(state: PyTree, specs: PyTree) -> None:
    """Refuses a global ``state`` whose arrays' types say a layout other than
    ``specs`` (a ``PartitionSpec`` per leaf or subtree): a program that gave
    zeroshard's state shardings of its own. A type carries its layout over Explicit
    mesh axes only (over Auto ones, inside ``jax.jit``, the program's shardings are
    the compiler's to apply, and nothing here can see them).

    Raises:
      ValueError: naming the first such leaf, both layouts and the fix.
    """

    def check(path: Any, spec: P, sub: Any) -> None:
        for x in jax.tree.leaves(sub):
            typed = getattr(jax.typeof(x), "sharding", None)
            mesh = getattr(typed, "mesh", None)
            axes = [a for a, t in zip(*_axes(mesh), strict=True) if t == AxisType.Explicit]
            if axes and _over(typed.spec, x.ndim, axes) != _over(spec, x.ndim, axes):
                raise ValueError(
                    "zs.sharded: the optimizer state's leaf "
                    f"opt_state{jax.tree_util.keystr(path)} is laid out as {typed.spec}, but "
                    f"zeroshard keeps it as {spec}: the program gave it shardings of its own. "
                    "Take the state's shardings from its own metadata (nn.get_partition_spec "
                    "or nnx.get_partition_spec of what tx.init returns, mapped with your "
                    "rules, keeps its layout), or leave the optimizer state's shardings "
                    "unspecified (None)."
                )

    jax.tree_util.tree_map_with_path(check, specs, state, is_leaf=lambda s: isinstance(s, P))


def _axes(mesh: Any) -> tuple[tuple, tuple]:
    """``mesh``'s axis names and types (none where there is no mesh)."""
    return getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())


def _over(spec: P, ndim: int, axes: list[str]) -> tuple:
    """``spec``'s entries, one per dimension, naming only ``axes``."""
    return tuple(tuple(a for a in e or () if a in axes) for e in _names(spec, ndim))
