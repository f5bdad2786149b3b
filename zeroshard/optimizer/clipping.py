"""Global-norm clipping for a user's own ``jax.shard_map`` code, outside ``zs.sharded``.

Inside :func:`zeroshard.sharded`, ``optax.clip_by_global_norm`` is supported as it
is: the analysis of the traced update (:mod:`zeroshard.analysis`) finds the partial
sums of squares behind its global norm, and :mod:`zeroshard.core.sums` sums them across
devices where the norm is used, so every device clips by the norm of the whole
gradient. In code of one's own whose updates are split over a mesh axis (a
hand-written ``shard_map`` step), ``optax.clip_by_global_norm`` would clip each
device's slice by that slice's norm; :func:`clip_by_global_norm` here adds the
partial sums over the axis itself, with one ``psum``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zeroshard.core.layout import PyTree


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

    For a user's own ``jax.shard_map`` code outside ``zs.sharded``, where each device
    holds a slice of the updates along ``axis_name`` (which must be bound): there
    ``optax.clip_by_global_norm`` would clip each slice by its own partial norm. Inside
    ``zs.sharded`` use ``optax.clip_by_global_norm`` itself: its global norm is summed
    across devices where it is used (this one works there too, summed once).

    Args:
      max_norm: the largest global norm let through.
      axis_name: the mesh axis the updates are sharded over.

    Returns:
      An optax ``GradientTransformation``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, zeroshard as zs
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> clip = zs.clip_by_global_norm(1.0, axis_name="data")
      >>> def clip_slices(updates):  # this device's slice of every leaf
      ...     return clip.update(updates, clip.init(updates))[0]
      >>> updates = {"w": jnp.full((4 * jax.device_count(),), 0.75)}  # norm >= 1.5
      >>> updates = jax.device_put(updates, jax.NamedSharding(mesh, P("data")))
      >>> clipped = jax.jit(jax.shard_map(clip_slices, mesh=mesh, in_specs=P("data"),
      ...                                 out_specs=P("data")))(updates)
      >>> print(f"{np.linalg.norm(clipped['w']):.4f}")  # the norm of the whole leaf
      1.0000
    """

    def update_fn(updates, state, params=None):
        del params
        norm = global_norm(updates, axis_name)
        # The same arithmetic as optax.clip_by_global_norm, with the global norm.
        clip = lambda u: jnp.where(norm < max_norm, u, (u / norm.astype(u.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
