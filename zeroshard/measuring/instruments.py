"""Instruments: bytes per device of live state, and the collectives of a compiled step."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import sharding_of

_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+[a-z]*)?)\[([\d,]*)\]")  # (fp8: f8e4m3fn)
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MLIR_OP = re.compile(r'"?stablehlo\.(all_reduce|reduce_scatter|all_gather|all_to_all)"?')
_MLIR_RESULT = re.compile(r"->\s*\(?tensor<(?:([\dx]*)x)?([a-z]+\d*)>")
_MLIR_GROUPS = re.compile(r"replica_groups = dense<[^>]*>\s*:\s*tensor<\d+x(\d+)xi64>")


def state_bytes_per_device(tree: PyTree) -> int:
    """Bytes one device holds for ``tree`` (the largest over devices).

    Reads live ``jax.Array`` shards; ``jax.ShapeDtypeStruct`` leaves with a sharding
    count their shard shape.

    Args:
      tree: a pytree of arrays, e.g. a ``TrainState`` or its ``opt_state``.

    Returns:
      The sum over leaves of the bytes of one device's shard.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> state_bytes_per_device({"a": jnp.zeros(10), "b": jnp.zeros((), jnp.int8)})
      41
    """

    def nbytes(x: Any) -> int:
        if isinstance(x, jax.Array):
            return max(s.data.nbytes for s in x.addressable_shards)
        sharding = sharding_of(x)
        shape = np.shape(x) if sharding is None else sharding.shard_shape(x.shape)
        return math.prod(shape) * np.dtype(x.dtype).itemsize

    return sum(map(nbytes, jax.tree.leaves(tree)))


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective in a compiled program.

    Attributes:
      kind: ``all-reduce``, ``reduce-scatter``, ``all-gather``, ...
      dtype: element type as the HLO prints it (CPU prints bf16 collectives as f32).
      result_bytes: bytes of the result on one device.
      group_size: devices taking part in each group.
      axes: the mesh axes each group spans, e.g. ``("data",)``, when the HLO names
        them or :func:`compiled_collectives` was given the mesh; empty when unknown.
      op_name: where in the program the collective comes from (the instruction's
        ``op_name`` metadata, e.g. ``jit(step)/shard_map/zeroshard/reduce_scatter/...``;
        :func:`zeroshard.measuring.scopes.scopes_of` reads zeroshard's scopes from it); empty
        when the HLO has none.
    """

    kind: str
    dtype: str
    result_bytes: int
    group_size: int
    axes: tuple[str, ...] = ()
    op_name: str = ""

    @property
    def ring_bytes(self) -> float:
        """Bytes each device sends with a ring algorithm.

        all-reduce of B bytes: 2(n-1)/n B; reduce-scatter to B: (n-1) B; all-gather to
        B: (n-1)/n B.
        """
        n = self.group_size
        factors = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}
        return factors.get(self.kind, (n - 1) / n) * self.result_bytes


def compiled_collectives(
    hlo_text: str, num_devices: int | None = None, mesh: jax.sharding.Mesh | None = None
) -> list[Collective]:
    """Lists the collectives of a compiled HLO module.

    Args:
      hlo_text: ``jit(f).lower(...).compile().as_text()``.
      num_devices: group size to assume when the HLO lists no replica groups
        (default: ``jax.device_count()``).
      mesh: the mesh the program runs on; with it each collective is attributed to
        the mesh axes its groups span (:attr:`Collective.axes`).

    Returns:
      One :class:`Collective` per collective instruction (async pairs counted once).
    """
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m["result"])
        if m["kind"] == "all-gather" and "-start(" in line:
            shapes = shapes[len(shapes) // 2 :]  # (operands..., results...)
        nbytes = sum(math.prod(_ints(dims)) * _itemsize(dtype) for dtype, dims in shapes)
        n, axes = _group(line, mesh)
        n = n or num_devices or jax.device_count()
        name = _OP_NAME.search(line)
        dtype = shapes[0][0] if shapes else "?"
        found.append(Collective(m["kind"], dtype, nbytes, n, axes, name[1] if name else ""))
    return found


def _group(line: str, mesh: jax.sharding.Mesh | None) -> tuple[int | None, tuple[str, ...]]:
    """Group size and spanned mesh axes of one collective's ``replica_groups``.

    XLA prints groups as lists (``{{0,1},{2,3}}``), as iota ranges
    (``[2,4]<=[2,4]T(1,0)``), or (newer versions) by mesh axis
    (``mesh['replica'=2,'data'=4] {'data'}``). Device ids are positions in the mesh.
    """
    if g := _GROUPS_MESH.search(line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", g[1]))
        axes = tuple(re.findall(r"'([^']+)'", g[2]))
        return math.prod(int(sizes[a]) for a in axes), axes
    if g := _GROUPS_LIST.search(line):
        group = _ints(g[1])
    elif g := _GROUPS_IOTA.search(line):
        dims = _ints(g[3])
        ids = np.arange(math.prod(dims)).reshape(dims)
        if g[4]:
            ids = ids.transpose(_ints(g[4]))
        group = list(ids.reshape(int(g[1]), int(g[2]))[0])
    else:
        return None, ()
    if mesh is None:
        return len(group), ()
    coords = np.unravel_index(group, mesh.devices.shape)
    axes = tuple(a for a, c in zip(mesh.axis_names, coords, strict=True) if len(set(c)) > 1)
    return len(group), axes


def summarize(found: list[Collective], per_axis: bool = False) -> dict[str, dict[str, float]]:
    """Counts, result bytes and ring bytes per collective kind (``per_axis``: per kind
    and mesh axes, keyed like ``"all-reduce over replica"``).

    Example:
      >>> summarize([Collective("all-reduce", "f32", 400, 4)])
      {'all-reduce': {'count': 1, 'bytes': 400, 'ring_bytes': 600.0}}
    """
    out: dict[str, dict[str, float]] = {}
    for c in found:
        key = f"{c.kind} over {'+'.join(c.axes) or '?'}" if per_axis else c.kind
        row = out.setdefault(key, {"count": 0, "bytes": 0, "ring_bytes": 0})
        row["count"] += 1
        row["bytes"] += c.result_bytes
        row["ring_bytes"] += c.ring_bytes
    return out


def lowered_collectives(stablehlo_text: str) -> list[Collective]:
    """The collectives of a lowered program (``jit(f).lower(...).as_text()``).

    This is the program JAX emits, before XLA optimises it: dtypes are exact (the
    compiled CPU HLO prints bf16 collectives as f32), and collectives the compiler
    would merge (e.g. a rematerialised all-gather with its forward twin, on CPU)
    are all still there. An op inside a loop body is listed once.
    """
    found = []
    for m in _MLIR_OP.finditer(stablehlo_text):
        segment = stablehlo_text[m.end() : m.end() + 4000]
        result = _MLIR_RESULT.search(segment)
        dims, dtype = (result[1] or "", result[2]) if result else ("", "?")
        size = math.prod(_ints(dims, "x"))
        groups = _MLIR_GROUPS.search(segment)
        n = int(groups[1]) if groups else jax.device_count()
        found.append(Collective(m[1].replace("_", "-"), dtype, size * _itemsize(dtype), n))
    return found


def collective_dtypes(stablehlo_text: str) -> list[tuple[str, str]]:
    """``(kind, element type)`` of each collective in a lowered program."""
    return [(c.kind, c.dtype) for c in lowered_collectives(stablehlo_text)]


def _ints(text: str, sep: str = ",") -> list[int]:
    """The integers of a ``sep``-separated list (``"2,4"``; ``""``: none)."""
    return [int(d) for d in text.split(sep) if d]


def _itemsize(hlo_dtype: str) -> int:
    """Bytes of one element of an HLO element type: the bits after its kind letters
    (``bf16``: 2, ``f8e4m3fn``: 1, ``s4``: 1); ``pred``: one byte."""
    bits = re.match(r"[a-z]+?(\d+)", hlo_dtype)
    return max(1, int(bits[1] if bits else 8) // 8)
