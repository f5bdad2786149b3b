"""Leaves: what the traced inner update needs, leaf by leaf (see :mod:`zeroshard.analysis`).

The update is traced on the full leaves and tagged (:mod:`zeroshard.analysis.tags`);
traced again on this device's slices, a leaf whose operations differ (its update
depends on its shape) is owned too; a stacked leaf that needs whole tensors is owned
layer by layer where its update keeps the layers apart (:mod:`zeroshard.analysis.layers`)
and does on one layer what it does on all of them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp

from zeroshard.analysis.groups import input_names, leaf_forms
from zeroshard.analysis.jaxprs import open_jaxpr, primitives
from zeroshard.analysis.layers import independent_layers
from zeroshard.analysis.tags import CLEAN_TAG, ELEM, PARTIAL, NotElementwiseError, Tag, Tagger
from zeroshard.communication.collectives import axis_env
from zeroshard.core.layout import PyTree

_FIX = (
    "zeroshard runs an update exactly when it treats leaves separately or combines them "
    "through sums (as a global norm does); non-finite steps are skipped by zs.sharded "
    "itself (skip_nonfinite=True), with no optax.apply_if_finite."
)


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the traced inner update needs, per leaf.

    Attributes:
      whole: the leaves whose update needs the whole tensor (to be owned).
      matrix: of those, the leaves whose whole-tensor work is matrix products (their
        cost grows as ``m * n * min(m, n)``, as Newton-Schulz does).
      state_leaves: per leaf of the inner state, the parameter leaf it derives from
        in the update, or ``None`` (counts, hyperparameters, leaves never updated).
      state_tags: the inner state's tags, as the update reads them.
      sums: the leaves of each partial sum that meets a non-linear operation (a
        norm, an RMS: one leaf; a global norm: several): where such a sum is partial
        (a leaf in it is sliced, or it spans leaves), the update runs with
        :func:`zeroshard.core.sums.run_with_sums`.
      layered: of the leaves in ``whole``, the stacked ones whose update treats each
        layer on its own (see :mod:`zeroshard.analysis.layers`): they can be owned layer by layer.
      layer_sums: of those, the leaves whose layers meet through total sums: owned
        layer by layer, those sums are summed over the devices, so every device must
        hold some of its layers.
      reads: the leaves whose weights the update reads (weight decay, trust ratios):
        the others' need not reach their owners.
      forms: per leaf, the form of its update on its piece
        (:func:`zeroshard.analysis.groups.leaf_forms`: equal for alike leaves), or
        ``None``; ``()`` where the update was not traced on pieces.
      extras: the extra arguments the update requires and was not given (traced
        with a float32 scalar in each one's place, as :func:`trace_update` does):
        every ``tx.update`` must pass them.
    """

    whole: frozenset[int]
    matrix: frozenset[int]
    state_leaves: tuple[int | None, ...]
    state_tags: tuple[Tag, ...] = ()
    sums: frozenset[frozenset[int]] = frozenset()
    layered: frozenset[int] = frozenset()
    layer_sums: frozenset[int] = frozenset()
    reads: frozenset[int] = frozenset()
    forms: tuple[tuple | None, ...] = ()
    extras: tuple[str, ...] = ()

    def stand_ins(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What the update was traced with in the place of :attr:`extras`."""
        return {k: jax.ShapeDtypeStruct((), jnp.float32) for k in self.extras}

    def in_tags(self, leaves: list[int], state: list[int]) -> list[Tag]:
        """Tags of the update's inputs: gradients, state, parameters (extra arguments
        are clean), for a tree of the parameter ``leaves`` and the inner state's
        leaves ``state``."""
        params = [(ELEM, frozenset([i])) for i in leaves]
        return params + [self.state_tags[k] for k in state] + params


_MISSING = re.compile(r"missing \d+ required keyword-only arguments?: (.*)")

_CALLS_BACK = (
    "an update that calls a function it is given (value_fn=, as optax.lbfgs's zoom line "
    "search does to evaluate the loss at trial parameters) would call it on this "
    "device's part of the parameters, not on whole ones, so zs.sharded refuses it. Use "
    "plain optax for such an optimizer (L-BFGS's state is a few copies of the "
    "parameters), or a first-order one; extra arguments that are values (the value= of "
    "optax.polyak_sgd and optax.contrib.reduce_on_plateau) are passed on."
)


def trace_update(inner: Any, params: PyTree, state: PyTree, axis_name: str, num_shards: int, extra):
    """The closed jaxpr of ``inner.update``, and the extra arguments it was traced with:
    ``extra`` plus a float32 scalar for each keyword argument the update requires that
    ``extra`` lacks (e.g. the ``value=`` of ``optax.polyak_sgd``).

    Raises:
      ValueError: if the update requires extra arguments and cannot be traced with
        scalars in their place (a function it calls, as ``optax.lbfgs``'s
        ``value_fn=``), naming them and why.
    """
    extra, invented = dict(extra), []
    fn = lambda u, s, p, e: inner.update(u, s, p, **e)
    while True:
        try:
            jaxpr = jax.make_jaxpr(fn, axis_env=axis_env(axis_name, num_shards))
            return jaxpr(params, state, params, extra), extra
        except Exception as e:
            missing = _MISSING.search(str(e)) if isinstance(e, TypeError) else None
            names = re.findall(r"'(\w+)'", missing.group(1)) if missing else []
            if names and not set(names) & extra.keys():
                invented += names
                extra.update((k, jax.ShapeDtypeStruct((), jnp.float32)) for k in names)
                continue
            if not invented:
                raise
            raise _refused(invented, e) from e


def _refused(names: list[str], error: Exception) -> ValueError:
    given = ", ".join(f"{k}=" for k in names)
    first = (str(error).splitlines() or [""])[0]
    return ValueError(
        f"zs.sharded: the inner optimizer's update requires {given} and zeroshard plans "
        "the placement before the first step from the update traced with a float32 scalar "
        f"in each one's place, which failed ({type(error).__name__}: {first}). Values "
        f"given as tx.update(grads, state, params, {given}...) are passed on, but "
        f"{_CALLS_BACK}"
    )


def check_extra_args(extra_args: dict[str, Any], required: Collection[str] = ()) -> None:
    """Refuses, with the reason and the fix, extra arguments of ``tx.update`` that the
    sharded update cannot pass on exactly (a function of the parameters), or that miss
    one the inner update ``required`` (found when it was traced before the first step).

    Raises:
      ValueError: for a callable extra argument.
      TypeError: for a missing required one.
    """
    called = sorted(k for k, v in extra_args.items() if callable(v))
    if called:
        names = ", ".join(f"{k}=" for k in called)
        raise ValueError(f"zs.sharded(...).update got {names} a function: {_CALLS_BACK}")
    missing = [k for k in required if k not in extra_args]
    if missing:
        names = ", ".join(f"{k}=..." for k in missing)
        raise TypeError(
            f"zs.sharded: the inner optimizer's update requires {names}; pass it on: "
            f"tx.update(grads, opt_state, params, {names}) (in Flax, "
            f"optimizer.update(model, grads, {names})). zs.make_train_step and the Flax "
            "steps pass value= (the step's mean loss) only: call tx.update in your own "
            "step for this one."
        )


def analyze(
    inner: Any,
    full_params: PyTree,
    full_state: PyTree,
    piece_params: PyTree,
    piece_state: PyTree,
    axis_name: str,
    num_shards: int,
    stacked: tuple[int, ...] = (),
    extra_args: dict[str, Any] | None = None,
) -> Analysis:
    """Finds the leaves whose inner update needs the whole tensor (or whole layers).

    Args:
      inner: the optax transformation to run on this device's part of the parameters.
      full_params: ``ShapeDtypeStruct`` tree of the full parameters (master dtype).
      full_state: ``jax.eval_shape(inner.init, full_params)``.
      piece_params: the same tree with this device's slices.
      piece_state: ``jax.eval_shape(inner.init, piece_params)``.
      axis_name: the sharded mesh axis.
      num_shards: its size.
      stacked: per leaf, its number of leading layer axes (none if empty).
      extra_args: ``ShapeDtypeStruct``s of the inner update's extra arguments (those
        it requires and is not given are traced as float32 scalars).

    Raises:
      NotElementwiseError: where the update mixes several leaves without a psum over
        ``axis_name`` (no placement makes that exact).
    """
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(full_params)]
    n_params, n_state = len(names), len(jax.tree.leaves(full_state))
    params_in = [(ELEM, frozenset([i])) for i in range(n_params)]
    trace = lambda params, state, extra: trace_update(
        inner, params, state, axis_name, num_shards, extra
    )
    full, extra = trace(full_params, full_state, extra_args or {})

    def tag(jaxpr: Any, state_in: list[Tag]) -> tuple[Tagger, list[Tag]]:
        tagger = Tagger(axis_name, names)  # the extra arguments: clean
        return tagger, tagger.run(jaxpr, params_in + state_in + params_in)[0]

    try:
        # A second pass gives the state the tags the first pass computed for it.
        state_in = tag(full, [CLEAN_TAG] * n_state)[1][n_params:]
        tagger, outs = tag(full, state_in)
    except NotElementwiseError as e:
        raise NotElementwiseError(
            f"zs.sharded cannot run this inner optimizer exactly on any placement of the "
            f"parameters over {num_shards} devices: {e}. {_FIX}"
        ) from None
    state_leaves = _state_leaves(outs, names, full_state)
    whole, forms = set(tagger.whole), ()
    try:  # leaf by leaf: does the update do on a slice what it does on the full leaf?
        pieces = trace(piece_params, piece_state, extra)[0]
        sliced = tag(pieces, state_in)[0]
        whole |= {i for i in range(n_params) if sliced.ops[i] != tagger.ops[i]}
        names = input_names((piece_params, piece_state, piece_params, extra))
        found = leaf_forms(pieces, list(range(n_params)), list(state_leaves), names)
        forms = tuple(found[i] for i in range(n_params))
    except NotElementwiseError:
        whole = set(range(n_params))
    candidates = [i for i in sorted(whole) if stacked and stacked[i] == 1]
    # Those independent layer by layer, and of those the ones whose layers meet in sums.
    layered, summed = independent_layers(full, full_params, full_state, state_leaves, candidates)
    if layered:  # does the update do on one layer what it does on all of them?
        params, state = _some_layers(inner, full_params, full_state, state_leaves, layered)
        one = trace(params, state, extra)[0] if layered else full
        if primitives(one) != primitives(full):
            layered = set()
    return Analysis(
        frozenset(whole),
        frozenset(tagger.matrix),
        state_leaves,
        tuple(state_in),
        frozenset(tagger.sums),
        frozenset(layered),
        frozenset(summed & layered),
        _reads(full, n_params, n_state),
        forms,
        tuple(k for k in extra if k not in (extra_args or {})),
    )


def _reads(closed: Any, n_params: int, n_state: int) -> frozenset[int]:
    """The parameter leaves whose weights (inputs after the gradients and the state)
    the traced update uses at all."""
    jaxpr = open_jaxpr(closed)
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    weights = jaxpr.invars[n_params + n_state : 2 * n_params + n_state]
    return frozenset(i for i, v in enumerate(weights) if id(v) in used)


def _some_layers(inner, full_params, full_state, state_leaves, layered):
    """The parameters with one layer of each ``layered`` leaf, and their state; drops
    from ``layered`` a leaf whose state on one layer is not one layer of its state."""
    one = lambda i, x: jax.ShapeDtypeStruct((1, *x.shape[1:]) if i in layered else x.shape, x.dtype)
    leaves, treedef = jax.tree.flatten(full_params)
    params = treedef.unflatten(one(i, x) for i, x in enumerate(leaves))
    state = jax.eval_shape(inner.init, params)
    if jax.tree.structure(state) != jax.tree.structure(full_state):
        layered.clear()
    else:
        pairs = zip(jax.tree.leaves(full_state), jax.tree.leaves(state), strict=True)
        for j, (full, x) in zip(state_leaves, pairs, strict=True):
            if j in layered and tuple(x.shape) != (1, *full.shape[1:]):
                layered.discard(j)
    return params, state


def _state_leaves(outs: list[Tag], names: list[str], full_state: PyTree) -> tuple[int | None, ...]:
    """Checks the tags of the update's outputs (each parameter's update from itself
    alone, each state leaf from at most one parameter, no sum left partial) and
    returns, per state leaf, the parameter it derives from (or ``None``).

    Raises:
      NotElementwiseError: naming the first output that breaks one of these.
    """
    n_params = len(names)
    for i, (kind, leaves) in enumerate(outs[:n_params]):
        if kind == PARTIAL or not leaves <= {i}:
            why = "other parameters: " + ", ".join(names[j] for j in sorted(leaves - {i}))
            if kind == PARTIAL:
                why = "a sum over this device's slice that is never summed across the axis"
            raise NotElementwiseError(
                f"zs.sharded: the update of {names[i]} depends on {why}. {_FIX}"
            )
    state_paths = jax.tree_util.tree_flatten_with_path(full_state)[0]
    for (path, _), (kind, leaves) in zip(state_paths, outs[n_params:], strict=True):
        if kind == PARTIAL or len(leaves) > 1:
            raise NotElementwiseError(
                f"zs.sharded: inner state leaf {jax.tree_util.keystr(path)} depends on several "
                f"parameters, or on a sum that is never summed across the axis. {_FIX}"
            )
    return tuple(min(leaves, default=None) for _, leaves in outs[n_params:])
