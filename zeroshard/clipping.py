"""Global-norm clipping that sees every device's slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zeroshard.layout import PyTree


def global_norm(tree: PyTree, axis_name: str) -> jax.Array:
    """The L2 norm over all elements of ``tree`` on every device along ``axis_name``.

    Each device sums the squares of its own elements; one scalar ``psum`` combines the
    partial sums before the square root. Zero padding contributes nothing.

    Args:
      tree: this device's slice of a tree of arrays.
      axis_name: the mesh axis the tree is sharded over.

    Returns:
      The global norm, a float32 scalar equal on every device.
    """
    return jnp.sqrt(jax.lax.psum(local_squares(tree), axis_name))


def local_squares(tree: PyTree) -> jax.Array:
    """The sum of the squares of this device's elements of ``tree``, in float32."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return sum(squares, jnp.float32(0))


# Stateless, and the same state type as optax's clip, so a zeroshard chain's state has
# the same structure as the plain optax chain it replaces (checkpoints interoperate).
ClipByGlobalNormState = optax.EmptyState


def clip_by_global_norm(max_norm: float, *, axis_name: str) -> optax.GradientTransformation:
    """Clips updates so that their norm over *all* devices is at most ``max_norm``.

    The drop-in replacement for ``optax.clip_by_global_norm`` inside ``zs.sharded``:
    the stock one would clip each slice against its own partial norm. Outside a
    sharded optimizer it needs ``axis_name`` bound (e.g. inside ``jax.shard_map``).

    Args:
      max_norm: the largest global norm let through.
      axis_name: the mesh axis the updates are sharded over.

    Returns:
      An optax ``GradientTransformation``.

    Example:
      >>> import optax, zeroshard as zs
      >>> tx = zs.sharded(
      ...     optax.chain(zs.clip_by_global_norm(1.0, axis_name="data"), optax.adamw(1e-3)),
      ...     axis_name="data")
    """

    def init_fn(params: PyTree) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState()

    def update_fn(updates, state, params=None):
        del params
        norm = global_norm(updates, axis_name)
        # The same arithmetic as optax.clip_by_global_norm, with the global norm.
        clip = lambda u: jnp.where(norm < max_norm, u, (u / norm.astype(u.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(init_fn, update_fn)
