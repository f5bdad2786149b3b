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
