"""Integrity of a checkpoint: checksums computed on device, the record a step keeps of
them, the SHA-256 of its metadata record, and :class:`CheckpointCorruptedError`.

**Checksums** (:func:`checksums`, public as ``zs.checksums``) of logical leaves do not
depend on how the leaves are split. A leaf's checksum is a position-weighted sum: every
element's bits (as ``uint32`` words) are mixed with its flat index in the *global* array
by an integer hash (murmur3's finaliser), and the hashes are summed modulo 2**32.
Addition is associative and commutative, so each device hashes only its own block (the
compiler gives it its elements' global indices) and one all-reduce adds the blocks: the
value is the same on 1, 3 or 8 devices, for any split, and nothing is gathered.

A change of any single element always changes the checksum (the hash is a bijection
of the element's bits for a fixed position); a random change of several elements is
missed with probability 2**-32. It guards against damaged files, not against an
adversary.

**The record.** At save, :func:`record` computes the checksums of the step's logical
item (``{"step", "params", "opt_state"}``) and :class:`zeroshard.CheckpointManager`
stores the result in the step's JSON metadata::

    {"algorithm": "zeroshard-sum32-v1", "step": "30f4c306",
     "params": {"['w']": "cc4a938b", ...}, "opt_state": {"[0].mu['w']": "4d30ed22", ...}}

The JSON record itself carries a SHA-256 of its contents (:func:`digest`), checked
whenever it is read. At restore the same record is computed from the arrays read back and
:func:`first_mismatch` names the first leaf that differs. Leaves are keyed by
``jax.tree_util.keystr`` of their path; :func:`by_parts` re-keys a record by the bare
path (``0/mu/w``) to compare it with a tree read without the optimizer's types (as
``python -m zeroshard inspect --verify`` reads it).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, zeroshard as zs
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> x = jnp.arange(24.0).reshape(8, 3)
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> split = jax.device_put(x, NamedSharding(mesh, P("data")))
    >>> zs.checksums({"x": x}) == zs.checksums({"x": split})
    True
    >>> zs.checksums({"x": x.at[3, 1].set(-1.0)}) == zs.checksums({"x": x})
    False
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroshard.core.layout import PyTree
from zeroshard.core.mesh import is_placed


class CheckpointCorruptedError(ValueError):
    """A step's arrays are not what was saved: a file is damaged or truncated.

    Raised by :meth:`zeroshard.CheckpointManager.restore` and
    :meth:`~zeroshard.CheckpointManager.verify`; the message names the step (and the
    leaf, when a checksum differs) and lists the other steps. Nothing on disk is
    changed.
    """


ALGORITHM = "zeroshard-sum32-v1"
"""Recorded beside the checksums: the hash above, summed mod 2**32, as 8 hex digits."""

_GOLDEN = 0x9E3779B9  # spreads consecutive indices over the 32 bits


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection on ``uint32`` that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of each element as one ``uint32`` (wider elements are mixed down)."""
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _fmix32(_words(jnp.real(x))) ^ _words(jnp.imag(x))
    if dtype.itemsize <= 4:
        unsigned = jnp.dtype(f"uint{8 * dtype.itemsize}")
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., itemsize // 4)
    words = halves[..., 0]
    for k in range(1, halves.shape[-1]):
        words = _fmix32(words) ^ halves[..., k]
    return words


def _sum(x: jax.Array) -> jax.Array:
    """Sum of the element hashes of ``x`` (a global array: the compiler hashes each
    device's block where it lies, its positions the global ones, and adds the blocks)."""
    index = jnp.zeros(x.shape, jnp.uint32)
    for k in range(x.ndim):
        stride = math.prod(x.shape[k + 1 :]) % 2**32
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, k) * jnp.uint32(stride)
    hashed = _fmix32(_words(x) + index * jnp.uint32(_GOLDEN))
    # int32 wraps like uint32, and every backend's all-reduce has it
    total = jnp.sum(jax.lax.bitcast_convert_type(hashed, jnp.int32), dtype=jnp.int32)
    return jax.lax.bitcast_convert_type(total, jnp.uint32)


@functools.lru_cache(maxsize=64)
def checksum_program(mesh: jax.sharding.Mesh) -> Callable[..., jax.Array]:
    """The jitted program that :func:`checksums` runs for arrays laid out on ``mesh``:
    it returns their checksums as one replicated ``uint32`` vector (one transfer to the
    host for all of them). Compiled once per mesh and shapes, dtypes and shardings."""
    stacked = lambda *xs: jnp.stack([_sum(x) for x in xs])
    return jax.jit(stacked, out_shardings=NamedSharding(mesh, P()))


_whole = jax.jit(_sum)


def _read(x: jax.Array) -> np.ndarray:
    """A replicated array's value, also when the mesh spans other processes."""
    return np.asarray(x.addressable_data(0))


def checksums(tree: PyTree) -> PyTree:
    """The checksum of every array in ``tree``, whatever its sharding.

    Arrays laid out with a ``NamedSharding`` are hashed where they live: each device
    hashes its own block and the blocks are summed with one all-reduce (see the module
    docstring). Other arrays (host arrays, single-device arrays) are hashed whole.
    Under ``jax.distributed`` every process must call it, in the same order.

    Args:
      tree: a pytree of arrays.

    Returns:
      A tree like ``tree`` of Python ``int`` in ``[0, 2**32)``: the same for the same
      values in any layout on any number of devices.
    """
    leaves, treedef = jax.tree.flatten(tree)
    meshes = {x.sharding.mesh for x in leaves if is_placed(x)}
    placed = [i for i, x in enumerate(leaves) if len(meshes) == 1 and is_placed(x)]
    sums = {}
    if placed:
        arrays = [leaves[i] for i in placed]
        totals = _read(checksum_program(meshes.pop())(*arrays))
        sums = {i: int(total) for i, total in zip(placed, totals, strict=True)}
    whole = lambda x: int(_read(_whole(jnp.asarray(x))))
    return treedef.unflatten(sums[i] if i in sums else whole(x) for i, x in enumerate(leaves))


def record(item: dict[str, Any]) -> dict[str, Any]:
    """The checksums of a step's logical item (``{"step", "params", "opt_state", ...}``),
    as stored.

    Args:
      item: the arrays by name (any sharding; under jax.distributed every process
        calls it).

    Returns:
      ``{"algorithm": ..., name: checksum}`` for a single array (the step) and
      ``{name: {keystr(path): checksum}}`` for a tree; checksums as 8 hex digits.
    """
    sums = checksums(item)
    out: dict[str, Any] = {"algorithm": ALGORITHM}
    for what, tree in sums.items():
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        if len(flat) == 1 and flat[0][0] == ():
            out[what] = f"{flat[0][1]:08x}"
        else:
            out[what] = {jax.tree_util.keystr(path): f"{x:08x}" for path, x in flat}
    return out


RECORD_DIGEST = "record_sha256"


def digest(metadata: dict[str, Any]) -> str:
    """SHA-256 of a metadata record (without its own digest), as canonical JSON.

    The record holds state that is not in the arrays (the skipped-step count, the loss
    scale) and the checksums themselves, so it is checked too.
    """
    body = {k: v for k, v in metadata.items() if k != RECORD_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


_KEY = re.compile(r"\[(-?\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]|\.(\w+)")


def parts(path: str) -> str:
    """A leaf path without its kinds of keys: optax's ``[0].mu['w']`` and orbax's
    ``['0']['mu']['w']`` both give ``0/mu/w``."""
    return "/".join(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))


def by_parts(recorded: dict[str, Any]) -> dict[str, Any]:
    """``recorded`` with its leaves keyed by :func:`parts` of their paths."""
    return {
        what: {parts(p): v for p, v in sums.items()} if isinstance(sums, dict) else sums
        for what, sums in recorded.items()
    }


def _leaves(sums: Any) -> dict[str, Any]:
    return sums if isinstance(sums, dict) else {} if sums is None else {"": sums}


def first_mismatch(recorded: dict[str, Any], got: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first leaf whose checksum differs: ``(name, read, recorded)``, or ``None``."""
    for what in dict.fromkeys([*recorded, *got]):
        if what == "algorithm":
            continue
        want, have = _leaves(recorded.get(what)), _leaves(got.get(what))
        for path in dict.fromkeys([*want, *have]):
            if want.get(path) != have.get(path):
                return f"{what}{path}", have.get(path), want.get(path)
    return None


def leaf_count(recorded: dict[str, Any]) -> int:
    """How many leaves a record covers (the step counter included)."""
    return sum(len(_leaves(v)) for k, v in recorded.items() if k != "algorithm")


@dataclasses.dataclass(frozen=True)
class Where:
    """A checkpoint's step as messages name it, and how a corruption message ends.

    Attributes:
      directory: the checkpoint's directory (or the item's, in an orbax checkpoint).
      step: the step, or ``None`` where it is not known yet (the directory alone).
      others: the last sentence of a corruption message (the other steps to restore
        instead, or that nothing on disk changed), called only then.
    """

    directory: str
    step: int | None
    others: Callable[[], str]

    def __str__(self) -> str:
        return self.directory if self.step is None else f"step {self.step} of {self.directory}"


def read_or_refuse(read: Callable[[], Any], where: Where, what: str = "") -> Any:
    """``read()`` (an orbax restore), waited for; any error reading damaged or truncated
    files (orbax and tensorstore raise many types, json its own) becomes a
    :class:`CheckpointCorruptedError` naming ``what`` of ``where``."""
    try:
        return jax.block_until_ready(read())
    except Exception as e:
        reason = str(e).split(" [tensorstore_spec")[0][:400]
        raise CheckpointCorruptedError(
            f"could not read {what}{where}: the checkpoint is truncated or corrupted "
            f"({type(e).__name__}: {reason}). {where.others()}"
        ) from e
