"""Checkpoint integrity: the checksum record of a saved step, and checking it.

At save, :func:`record` computes :func:`zeroshard.checksums` of the step's logical
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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import jax

from zeroshard.checksum import ALGORITHM, checksums, hexdigest


class CheckpointCorruptedError(ValueError):
    """A step's arrays are not what was saved: a file is damaged or truncated.

    Raised by :meth:`zeroshard.CheckpointManager.restore` and
    :meth:`~zeroshard.CheckpointManager.verify`; the message names the step (and the
    leaf, when a checksum differs) and lists the other steps. Nothing on disk is
    changed.
    """


def record(
    item: dict[str, Any], key: Callable[[Any], str] = jax.tree_util.keystr
) -> dict[str, Any]:
    """The checksums of a step's logical item (``{"step", "params", "opt_state", ...}``),
    as stored.

    Args:
      item: the arrays by name (any sharding; under jax.distributed every process
        calls it).
      key: how a leaf's path becomes its key (default: ``jax.tree_util.keystr``).

    Returns:
      ``{"algorithm": ..., name: checksum}`` for a single array (the step) and
      ``{name: {key(path): checksum}}`` for a tree; checksums as 8 hex digits.
    """
    sums = checksums(item)
    out: dict[str, Any] = {"algorithm": ALGORITHM}
    for what, tree in sums.items():
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        if len(flat) == 1 and flat[0][0] == ():
            out[what] = hexdigest(flat[0][1])
        else:
            out[what] = {key(path): hexdigest(x) for path, x in flat}
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


def parts(path: Any) -> str:
    """A leaf path without its kinds of keys: optax's ``[0].mu['w']`` and orbax's
    ``['0']['mu']['w']`` (or their key tuples) both give ``0/mu/w``."""
    if not isinstance(path, str):
        path = jax.tree_util.keystr(path)
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
