"""Branches: per-owner work in one SPMD program.

Devices that own different leaves see different trees: each runs the inner
optimizer on its pieces of the sliced leaves, the whole leaves it owns, and a
one-element stand-in for every leaf owned elsewhere. Devices that own the same
leaves share a *branch* (:attr:`zeroshard.core.placement.Plan.branches`); a
``lax.switch`` on the device's index runs each device's branch only. What only an
owner keeps (the owned leaves' optimizer state and master weights) is packed into
per-device storage rows (:class:`zeroshard.core.placement.Storage`), padded to the most
loaded branch, so every device's state has the same shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.communication.collectives import varies, vary
from zeroshard.core.blocks import init_blocked
from zeroshard.core.layout import PyTree
from zeroshard.core.lowbit import is_codes
from zeroshard.core.placement import Plan
from zeroshard.core.rows import pack, unpack
from zeroshard.core.state_kinds import ReplicatedState


def run_branches(plan: Plan, axis_name: str, fn: Any, *args: Any) -> Any:
    """``fn(branch, *args)`` for this device's branch: a ``lax.switch`` on the device's
    index over the branches (each device runs only its own), or a plain call when
    every device has the same view."""
    if len(plan.branches) == 1:
        return fn(0, *args)
    index = jnp.asarray(plan.branch_of, jnp.int32)[jax.lax.axis_index(axis_name)]

    def branch(b, *args):  # every output varies over the axis, as the switch's do
        return varying(fn(b, *args), axis_name)

    branches = [functools.partial(branch, b) for b in range(len(plan.branches))]
    return jax.lax.switch(index, branches, *args)


def varying(tree: PyTree, axis_name: str) -> PyTree:
    """``tree`` typed as varying over ``axis_name`` (a cast; no data moves)."""
    return jax.tree.map(lambda x: vary(x, axis_name), tree)


def varying_like(tree: PyTree, like: PyTree, axis_name: str) -> PyTree:
    """``tree`` with each leaf typed varying over ``axis_name`` where the same leaf of
    ``like`` is: an update's new state, as the old state is typed, so that the two
    branches of the non-finite conditional agree. A leaf the update builds from
    constants (the factored moments of a one-element stand-in, say) is invariant,
    while its old value from a branch is varying."""
    return jax.tree.map(lambda x, y: vary(x, axis_name) if varies(y, axis_name) else x, tree, like)


def replicated_again(plan: Plan, axis_name: str, inner_state: PyTree) -> PyTree:
    """The replicated leaves of ``inner_state`` after :func:`run_branches`, typed
    invariant over ``axis_name`` again: equal everywhere, device 0's are taken, with
    one small all-gather per dtype."""
    if len(plan.branches) == 1:
        return inner_state
    leaves = plan.state_treedef.flatten_up_to(inner_state)
    replicated = [k for k, x in enumerate(plan.state_kinds) if type(x) is ReplicatedState]
    keys = {k: jax.random.key_impl(leaves[k]) for k in replicated if _is_key(leaves[k])}
    flat = {k: jax.random.key_data(leaves[k]) if k in keys else leaves[k] for k in replicated}
    for dtype in dict.fromkeys(x.dtype for x in flat.values()):  # the same order everywhere
        group = [k for k in replicated if flat[k].dtype == dtype]
        row = pack([flat[k] for k in group], dtype)
        row = jax.lax.all_gather(row, axis_name, to="invarying")[0]
        for k, x in zip(group, unpack(row, [flat[k].shape for k in group]), strict=True):
            leaves[k] = jax.random.wrap_key_data(x, impl=keys[k]) if k in keys else x
    return plan.state_treedef.unflatten(leaves)


def _is_key(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def kept_and_stored(plan: Plan, branch: int, state: PyTree, local: list) -> tuple:
    """Inner ``state`` of ``branch`` split into the tree it keeps (``None`` at owned
    leaves) and its storage rows (owned state, plus the owned master weights taken
    from ``local``, what the branch holds of its owned leaves)."""
    leaves = plan.state_treedef.flatten_up_to(plan.on_state.compact(state))
    kinds = list(zip(plan.state_kinds, leaves, strict=True))
    values = {("state", k): x for k, (kind, x) in enumerate(kinds) if kind.stored}
    values.update((("master", i), local[i]) for i, _ in plan.branches[branch])  # (if kept)
    kept = [None if kind.stored else x if is_codes(x) else kind.encoded(x) for kind, x in kinds]
    return plan.state_treedef.unflatten(kept), plan.storage.pack(values, branch)


def stored_state(plan: Plan, kept: PyTree, stored: dict) -> PyTree:
    """The inner state of ``branch``: the kept tree with its owned leaves filled in from
    ``stored`` (:meth:`zeroshard.core.placement.Storage.unpack` of its rows); its coded
    leaves stay coded (:mod:`zeroshard.core.piecewise` decodes them)."""
    leaves = plan.state_treedef.flatten_up_to(kept)
    return plan.state_treedef.unflatten(
        stored[("state", k)] if kind.stored else x
        for k, (kind, x) in enumerate(zip(plan.state_kinds, leaves, strict=True))
    )


def owned_wholes(plan: Plan, params: PyTree) -> list[jax.Array | None]:
    """The full leaves of ``params`` that are owned, in the inner dtypes (``None`` for
    sliced leaves)."""
    layout, dtypes = plan.layout, plan.inner_dtypes
    return layout.owned(
        lambda s, x: x.astype(dtypes[s.bucket]), layout.treedef.flatten_up_to(params)
    )


def init_parts(
    inner: Any,
    plan: Plan,
    axis_name: str,
    pieces: list[jax.Array | None],
    wholes: list[jax.Array | None],
) -> tuple[PyTree, tuple[jax.Array, ...]]:
    """This device's initial inner state (``None`` at owned leaves and hidden ones') and
    owned rows, from its master pieces of the sliced leaves (grouped) and the owned
    leaves' full master weights."""

    def init_branch(b, pieces, wholes):
        local = plan.local_wholes(b, wholes, axis_name)
        view = plan.on_view.filled(plan.view(b, pieces, local, axis_name))
        if plan.layout.blocked:  # (traced whole, evaluated on the blocks)
            state = init_blocked(inner, view, plan.block_marks(), axis_name, plan.layout.num_shards)
        else:
            state = inner.init(view)
        return kept_and_stored(plan, b, state, local)

    inner_state, owned = run_branches(plan, axis_name, init_branch, pieces, wholes)
    return replicated_again(plan, axis_name, inner_state), owned
