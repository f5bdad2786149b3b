"""Scopes: the names zeroshard's work carries in a profile and in compiled op names.

Each part of the update flow runs inside ``jax.named_scope("zeroshard/<part>")``, so
its operations carry that name in the compiled program (each HLO instruction's
``op_name`` metadata, e.g. ``jit(step)/shard_map/zeroshard/reduce_scatter/...``) and
in a profile (``jax.profiler``: TensorBoard, Perfetto, XProf). The names are stable:

- ``zeroshard/reduce_scatter``: the gradients' reduce-scatter (stages 1 and 2);
- ``zeroshard/cut``: each device cuts its part out of the mean gradient (the drop-in
  ``tx.update`` in a user's ``jax.jit``; no collective);
- ``zeroshard/to_owners``: stage 3, the owned leaves' gradient pieces (and the
  weights their update reads) go to their owners, one ``all_to_all`` per dtype;
- ``zeroshard/replica_mean``: the mean over ``replica_axis`` (hierarchical sharding);
- ``zeroshard/grad_norm``: the global gradient norm and finite check (one all-reduce);
- ``zeroshard/update``: the inner optimizer on this device's part, with the
  non-finite skip and the loss scale's bookkeeping;
- ``zeroshard/all_gather``: the new weights' all-gather (stages 1 and 2);
- ``zeroshard/from_owners``: stage 3, the owners' new units go back to every
  device's pieces, one ``all_to_all`` per dtype;
- ``zeroshard/gather``: stage 3, a layer's weights gathered (:func:`zeroshard.gather`,
  :func:`zeroshard.layer`). Its transpose in the backward pass, the gradients'
  reduce-scatter, is named ``transpose(jvp(zeroshard/gather))``;
- ``zeroshard/metrics``: a step's metrics (the global mean loss, aux), in
  :func:`zeroshard.make_train_step` and the Flax steps;
- ``zeroshard/model_state``: a step's average of the model state (BatchNorm
  statistics) over the batch axes.

Example:
    >>> import jax, jax.numpy as jnp
    >>> with scope(UPDATE):
    ...     pass  # operations traced here are named "zeroshard/update/..."
    >>> scopes_of("jit(step)/shard_map/zeroshard/reduce_scatter/reduce_scatter")
    ('reduce_scatter',)
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager

import jax

PREFIX = "zeroshard"
SCOPES = (
    REDUCE_SCATTER := "reduce_scatter",
    CUT := "cut",
    TO_OWNERS := "to_owners",
    REPLICA_MEAN := "replica_mean",
    GRAD_NORM := "grad_norm",
    UPDATE := "update",
    ALL_GATHER := "all_gather",
    FROM_OWNERS := "from_owners",
    GATHER := "gather",
    METRICS := "metrics",
    MODEL_STATE := "model_state",
)
"""Every scope name, in the order of the update flow (without the prefix)."""

_PREFIXED = re.compile(rf"{PREFIX}/(\(|[^/()]+)")


def scope(name: str) -> AbstractContextManager:
    """``jax.named_scope("zeroshard/<name>")`` for one of :data:`SCOPES`."""
    return jax.named_scope(f"{PREFIX}/{name}")


def scopes_of(op_name: str) -> tuple[str, ...]:
    """The zeroshard scopes (without the prefix) an operation named ``op_name`` is in:
    none outside them, one as a rule, several where the compiler merged operations of
    several scopes into one (XLA names a combined all-reduce
    ``.../zeroshard/(grad_norm/psum:metrics/psum)``).

    Example:
        >>> scopes_of("jit(step)/shard_map/zeroshard/reduce_scatter/reduce_scatter")
        ('reduce_scatter',)
        >>> scopes_of("jit(step)/shard_map/zeroshard/(grad_norm/psum:metrics/psum)")
        ('grad_norm', 'metrics')
        >>> scopes_of("jit(step)/shard_map/transpose(jvp(zeroshard/gather))/reduce_scatter")
        ('gather',)
    """
    found: list[str] = []
    for m in _PREFIXED.finditer(op_name):
        parts = _merged(op_name, m.end()) if m[1] == "(" else [m[1]]
        found += [p.split("/")[0] for p in parts]
    return tuple(name for name in dict.fromkeys(found) if name in SCOPES)


def _merged(op_name: str, start: int) -> list[str]:
    """The names merged in a ``(a:b;c)`` group of ``op_name`` opening before ``start``."""
    parts, depth, begin = [], 0, start
    for k, c in enumerate(op_name[start:], start):
        if c == "(":
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        elif c == ")" or (c in ":;" and not depth):
            parts.append(op_name[begin:k])
            begin = k + 1
            if c == ")":
                break
    return parts
