"""The baseline the benchmarks compare against: replicated data parallelism.

Plain optax in a ``shard_map`` over ``"data"``: each device takes the gradient of its
share of the batch, ``pmean`` all-reduces it, and every device runs the full update.
Imported by the benchmark scripts after they have set the device count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def replicated_step(loss_fn: Callable, inner: Any, mesh: Any) -> Any:
    """A jitted ``step(params, opt_state, batch) -> (params, opt_state)`` that donates
    its state; the batch is split over ``"data"``."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    def local(p, s, b):
        grads = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), b)
        updates, s = inner.update(jax.lax.pmean(grads, "data"), s, p)
        return optax.apply_updates(p, updates), s

    specs = (P(), P(), P("data"))
    step = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:2])
    return jax.jit(step, donate_argnums=(0, 1))


def state_shardings(inner: Any, params: Any, mesh: Any, like: Callable | None = None) -> Any:
    """``NamedSharding``s for ``inner``'s state on ``params``, as flax's
    ``optimizer_sharding`` and MaxText lay it out: each leaf split over ``"data"`` along
    its first dimension that the axis divides (and not already split), replicated where
    none does; with ``like`` (``tree, mesh -> shardings``, the parameters' layout rule),
    laid out by that rule first."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, structs = mesh.shape["data"], jax.eval_shape(inner.init, params)
    own = jax.tree.map(lambda _: P(), structs) if like is None else like(structs, mesh)

    def spread(x, sharding):
        spec = tuple(getattr(sharding, "spec", sharding)) + (None,) * len(x.shape)
        free = (i for i, d in enumerate(x.shape) if spec[i] is None and d % n == 0 and d > 0)
        k = next(free, None)
        spec = (
            spec[: len(x.shape)] if k is None else (*spec[:k], "data", *spec[k + 1 : len(x.shape)])
        )
        return NamedSharding(mesh, P(*spec))

    return jax.tree.map(spread, structs, own)


def jit_sharded_step(
    loss_fn: Callable, inner: Any, mesh: Any, opt_shardings: Any, param_shardings: Any = None
) -> Any:
    """Plain optax under ``jax.jit``: params replicated (or laid out by
    ``param_shardings``), the state laid out by ``opt_shardings``, the batch split over
    ``"data"``; donates its state."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def step(p, s, b):
        updates, s = inner.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, updates), s

    whole = NamedSharding(mesh, P()) if param_shardings is None else param_shardings
    return jax.jit(
        step,
        in_shardings=(whole, opt_shardings, NamedSharding(mesh, P("data"))),
        out_shardings=(whole, opt_shardings),
        donate_argnums=(0, 1),
    )
