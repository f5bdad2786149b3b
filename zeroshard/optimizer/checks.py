"""Checks: the validators every step runs at trace time, with the fix in the message.

The stage is one of 1, 2, 3; the batch splits evenly over the devices (and
micro-batches). (The mesh's own checks are in :mod:`zeroshard.core.mesh`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroshard.core.layout import PyTree


def check_batch(
    batch: PyTree,
    num_shards: int,
    axis_name: str | tuple[str, ...],
    accum_steps: int = 1,
    parts: tuple[int, str] | None = None,
) -> None:
    """Refuses an empty batch, or one whose leading dimension does not split evenly over
    ``num_shards`` devices (times ``accum_steps`` micro-batches), or into ``parts``
    (the micro-batches of another strategy, and what they are called)."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError("the batch is empty: pass a pytree of arrays with a batch dimension.")
    count = num_shards * accum_steps
    noun = "axes" if isinstance(axis_name, tuple) else "axis"
    what = f"the {num_shards} devices of {noun} {axis_name!r}"
    if accum_steps > 1:
        what += f" times accum_steps={accum_steps}"
    if parts is not None:
        count, what = parts
    for path, x in leaves:
        shape = jnp.shape(x)
        if not shape or shape[0] % count:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}: its leading "
                f"(global batch) dimension must be divisible by {what}. Use a global "
                f"batch size that is a multiple of {count}."
            )
