"""Groups: the leaves whose traced update is one and the same computation.

Two leaves are *alike* when, in the update traced on this device's pieces, the
equations that compute each one's new values are the same: the same primitives with
the same parameters, literals, constants and shapes, applied to its own gradient,
weights and state in the same roles and to the same shared values (the step count,
a learning rate, an extra argument). A different learning rate, a mask, a
``multi_transform`` label or a per-leaf weight decay shows in those equations and
keeps two leaves apart. Alike leaves' pieces laid end to end can then be updated as
one buffer, element for element as they are updated one by one, when the update is
elementwise (no sums over a leaf: :mod:`zeroshard.core.placement` checks that).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from zeroshard.analysis.jaxprs import open_jaxpr, walk


def leaf_forms(
    closed: Any,
    leaves: list[int],
    state_leaves: list[int | None],
    names: list[str],
) -> dict[int, tuple | None]:
    """Each leaf's *form*: a digest of the computation of its outputs in the update
    jaxpr ``closed``, traced as ``update(grads, state, params, *extra)``; alike leaves
    have equal forms.

    Args:
      closed: the traced update (closed jaxpr).
      leaves: the parameter leaf at each place of the traced parameters.
      state_leaves: per leaf of the traced inner state, the parameter leaf it derives
        from, or ``None`` (shared, like a step count).
      names: the name of each input (its path in the arguments): a shared input is
        known by it, so forms from traces of different trees compare.

    Returns:
      Per leaf its form, or ``None`` where its update reads another leaf's gradient,
      weights or state other than through a total sum (a global norm over several
      leaves, shared by all of them).
    """
    jaxpr = open_jaxpr(closed)
    n_params, n_state = len(leaves), len(state_leaves)
    roles: dict[Any, tuple[int, str]] = {}  # an input -> (its leaf, its role)
    counts: dict[int, int] = defaultdict(int)
    outs: dict[int, list[tuple[str, int]]] = defaultdict(list)  # (role, output)
    for k, i in enumerate(leaves):
        roles[jaxpr.invars[k]] = (i, "g")
        roles[jaxpr.invars[n_params + n_state + k]] = (i, "p")
        outs[i].append(("u", k))
    for k, i in enumerate(state_leaves):
        if i is not None:
            roles[jaxpr.invars[n_params + k]] = (i, f"s{counts[i]}")
            outs[i].append((f"s{counts[i]}", n_params + k))
            counts[i] += 1
    # Each value's digest: of its computation, with a leaf's own inputs named by their
    # role alone, so alike leaves' values have equal digests; and the leaves it reads.
    ins = []
    for v, name in zip(jaxpr.invars, names, strict=True):
        role = roles.get(v)
        read = frozenset([role[0]]) if role else _NONE
        ins.append((_digest(f"{role[1] if role else name}:{v.aval}"), read))
    values = _flow(closed, ins)
    return {
        i: None
        if any(values[v][1] - {i} for _, v in outs[i])
        else tuple((role, values[v][0]) for role, v in outs[i])
        for i in leaves
    }


_NONE: frozenset[int] = frozenset()


def _flow(closed: Any, ins: list[tuple[bytes, frozenset]]) -> list[tuple[bytes, frozenset]]:
    """The ``(digest, leaves read)`` of a (closed) jaxpr's outputs from its inputs';
    calls (``jit``, custom derivatives) are followed inside (:func:`walk` inlines
    them), so that a call over many leaves (a jitted tree map) keeps each leaf's
    values apart."""

    def step(e: Any, xs: list) -> list[tuple[bytes, frozenset]]:
        xs = [_known(x) for x in xs]
        head = f"{e.primitive.name}[{_params(e)}]".encode() + b"".join(d for d, _ in xs)
        read = _NONE.union(*(r for _, r in xs))
        if e.primitive.name == "reduce_sum" and all(v.aval.size == 1 for v in e.outvars):
            # A total sum (a global norm's) is a shared value, known by the leaves it sums.
            head, read = head + repr(sorted(read)).encode(), _NONE
        return [(_digest(head + f"{j}:{v.aval}".encode()), read) for j, v in enumerate(e.outvars)]

    return [_known(x) for x in walk(closed, ins, step)]


def _known(x: Any) -> tuple[bytes, frozenset]:
    """A value's ``(digest, leaves read)``; a constant or a literal (as :func:`walk`
    reads them: their values) is known by its value and reads no leaf."""
    return x if isinstance(x, tuple) else (_digest(_const(x)), _NONE)


def input_names(args: Any) -> list[str]:
    """The path of each leaf of a traced function's arguments (``keystr``)."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]


def _digest(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=16).digest()


def _params(eqn: Any) -> str:
    params = eqn.params
    return ", ".join(f"{k}={_value(v)}" for k, v in sorted(params.items()))


def _value(v: Any) -> str:
    """A parameter's text: a called jaxpr with its constants' values."""
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_value, v)) + ")"
    if open_jaxpr(v) is not None:
        return f"{v} consts {[_const(c) for c in getattr(v, 'consts', ())]}"
    return repr(v)


def _const(c: Any) -> str:
    """A constant's text: its type and a digest of its bytes."""
    try:
        a = np.asarray(c)
    except Exception:  # not an array (an opaque value): by identity, conservatively
        return f"const {id(c)}"
    return f"const {a.dtype}{a.shape} {hashlib.sha1(a.tobytes()).hexdigest()}"
