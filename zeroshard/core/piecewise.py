"""Piecewise: a low-bit state's update, decoded, updated and coded a piece at a time.

Coded state (:mod:`zeroshard.core.lowbit`) is what a device keeps between steps; the
inner optimizer reads and writes float32. Decoding a device's whole slice would hold
its float32 state, the new state and the coding's temporaries (the random numbers,
the ratios, the scales) at once: several times what the codes saved. So where the
inner update treats each element of a coded leaf on its own (no sum, no whole-tensor
work, no blocked leaf: Adam, Lion, SGD with momentum, ...), each such leaf is
updated in pieces of whole blocks, at most :data:`PIECE` elements each (of stacked
layers, a layer or a few; of a large matrix, a run of its blocks), one after the
other in a loop: its gradient, weights and state decoded for that piece only, the
inner update run on them, the new state coded again. The rest of the tree (its other
leaves, the counts) is updated by one more call with the pieced leaves left empty.
Where a step with a non-finite gradient is skipped, that call is in a conditional
and the loop runs no piece: the loop is not in the conditional, whose outputs are
buffers of their own (a second copy of the leaves' weights and codes).

A block's codes depend on its values only and the update is elementwise, so every
element gets the value, and every block the codes, the whole update would give. An
update with sums over elements (a global norm, LAMB's trust ratio) decodes the
device's whole slice, as it must.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.core.layout import PyTree
from zeroshard.core.lowbit import Codes
from zeroshard.core.placement import Plan
from zeroshard.core.state_kinds import ReplicatedState, SlicedState

PIECE = 2**17
"""The most elements of a coded leaf updated at once (512 KiB of each float32 state)."""

Apply = Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]


def pieced(plan: Plan) -> dict[int, tuple[int, ...]]:
    """The leaves updated in pieces, each with its state leaves (all coded): every
    leaf with coded state where the inner update is elementwise, else none."""
    kinds, analysis = plan.state_kinds, plan.analysis
    alone = all(type(x) in (SlicedState, ReplicatedState) for x in kinds)
    coded = {k for k, x in enumerate(kinds) if x.coding}
    if not coded or not alone or analysis.sums or analysis.whole or plan.layout.blocked:
        return {}
    states = {
        i: tuple(k for k, x in enumerate(kinds) if getattr(x, "leaf", None) == i)
        for i in {kinds[k].leaf for k in coded}
    }
    return {i: ks for i, ks in states.items() if coded.issuperset(ks)}


def updated(
    plan: Plan,
    apply: Apply,
    grads: PyTree,
    state: PyTree,
    params: PyTree,
    prepare: Any,
    finite: jax.Array | None = None,
) -> tuple:
    """``apply(grads, state, params) -> (new params, new state)``, the inner update on
    float32 state (its new state typed varying where the old is), run on ``state``
    whose coded leaves are :class:`Codes`: the new parameters and the new state, coded
    again. The gradients of the :func:`pieced` leaves are as they arrived:
    ``prepare(i, g)`` makes leaf ``i``'s piece ``g`` the inner optimizer's. With
    ``finite``, only where it is true: else all is kept as it was."""
    kinds = plan.state_kinds
    if not any(x.coding for x in kinds):
        return apply(grads, state, params)
    treedef, pieces = plan.layout.treedef, pieced(plan)
    leaves = plan.state_treedef.flatten_up_to(state)
    g, p = treedef.flatten_up_to(grads), treedef.flatten_up_to(params)
    done = {k for ks in pieces.values() for k in ks}

    def rest(g: list, leaves: list, p: list) -> tuple:
        # The pieced leaves empty, any other coded leaves decoded whole.
        state = plan.state_treedef.unflatten(
            [x if k in done else kinds[k].decoded(x) for k, x in enumerate(leaves)]
        )
        new, out = apply(treedef.unflatten(g), state, treedef.unflatten(p))
        out = plan.state_treedef.flatten_up_to(out)
        return treedef.flatten_up_to(new), [
            x if k in done else kinds[k].encoded(x) for k, x in enumerate(out)
        ]

    kept = lambda g, leaves, p: (p, leaves)
    g_rest = [prepare(i, _empty(x)) if i in pieces else x for i, x in enumerate(g)]
    p_rest = [_empty(x) if i in pieces else x for i, x in enumerate(p)]
    s_rest = [_empty(x) if k in done else x for k, x in enumerate(leaves)]
    run = rest if finite is None else functools.partial(jax.lax.cond, finite, rest, kept)
    new, out = run(g_rest, s_rest, p_rest)
    for i, ks in pieces.items():
        new[i], coded = _in_pieces(plan, apply, i, ks, g, p, leaves, prepare, finite)
        out = [coded.get(k, x) for k, x in enumerate(out)]
    return treedef.unflatten(new), plan.state_treedef.unflatten(out)


def _in_pieces(
    plan: Plan,
    apply: Apply,
    i: int,
    ks: tuple,
    g: list,
    p: list,
    state: list,
    prepare: Any,
    finite: jax.Array | None,
) -> tuple:
    """Leaf ``i``'s new weights and coded state leaves ``ks``, a piece at a time (the
    other leaves empty; its gradient made the inner optimizer's by ``prepare``), all
    pieces where ``finite`` is true or ``None``, none where it is false."""
    store, shape = plan.state_kinds[ks[0]].coding, p[i].shape
    trees = plan.layout.treedef, plan.state_treedef
    n = _count(math.prod(shape) // store.block, PIECE // store.block, shape[0])
    # Piece c: elements [c, c + 1) * size / n of each array, cut from its leading axis
    # where that divides (a stacked leaf's layers; reshaped, XLA may lay an array out
    # otherwise and copy it whole), else from its rows of size / n.
    rows = lambda x: x if x.shape[0] % n == 0 else x.reshape(n, -1)
    one = (*(1,) * (len(shape) - 1), -1)  # (a piece has the leaf's rank)
    replicated = lambda k: type(plan.state_kinds[k]) is ReplicatedState
    rest = [x if replicated(k) else _empty(x) for k, x in enumerate(state)]

    def piece(gi: jax.Array, pi: jax.Array, codes: list) -> tuple:
        gs, ps, ss = list(map(_empty, g)), list(map(_empty, p)), list(rest)
        gs[i], ps[i] = prepare(i, gi).reshape(one), pi.reshape(one)
        for k, (c, s) in zip(ks, codes, strict=True):
            ss[k] = store.decode(Codes(c.reshape(one), s.reshape(one), store.bits))
        new, new_state = apply(
            trees[0].unflatten(gs), trees[1].unflatten(ss), trees[0].unflatten(ps)
        )
        new_state = trees[1].flatten_up_to(new_state)
        coded = [store.encode(new_state[k]) for k in ks]
        new = trees[0].flatten_up_to(new)[i].reshape(-1)
        return new, [(c.codes.reshape(-1), c.scales.reshape(-1)) for c in coded]

    def at(c: jax.Array, carry: tuple) -> tuple:  # (piece c read, and written in its place)
        row = lambda x: jax.lax.dynamic_slice_in_dim(x, c * (len(x) // n), len(x) // n)
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(
            x, y.reshape(len(x) // n, *x.shape[1:]), c * (len(x) // n), 0
        )
        zero = lambda x: jnp.zeros_like(x[: len(x) // n])
        # The piece is read in a conditional (its outputs are buffers of their own, XLA
        # fuses no read of the whole arrays past it), so that every read comes before
        # every write in place: else XLA copies the arrays in every iteration.
        arrays = (grads, *carry)
        read = jax.lax.cond(
            c < n, lambda: jax.tree.map(row, arrays), lambda: jax.tree.map(zero, arrays)
        )
        return jax.tree.map(put, carry, piece(*read))

    grads, codes = rows(g[i]), [(rows(state[k].codes), rows(state[k].scales)) for k in ks]
    count = n if finite is None else jnp.where(finite, n, 0)
    new, coded = jax.lax.fori_loop(0, count, at, (rows(p[i]), codes))
    return new.reshape(shape), {
        k: Codes(c.reshape(state[k].codes.shape), s.reshape(state[k].scales.shape), store.bits)
        for k, (c, s) in zip(ks, coded, strict=True)
    }


def _count(blocks: int, most: int, lead: int) -> int:
    """The fewest pieces of whole blocks, all alike, that cut ``blocks`` blocks into
    pieces of at most ``most`` blocks: of whole rows of the leading axis (of ``lead``)
    where some such count does."""
    counts = range(-(-blocks // most), blocks + 1)
    return next((n for n in counts if blocks % n == 0 and lead % n == 0), None) or next(
        n for n in counts if blocks % n == 0
    )


def _empty(x: Any) -> Any:
    """State leaf ``x`` with no elements (coded: as float32, of its rank)."""
    return None if x is None else (x.scales if isinstance(x, Codes) else x)[..., :0]
