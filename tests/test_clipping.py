"""zs.global_norm and zs.clip_by_global_norm in a user's own shard_map: the norm over
every device's slice, not this device's partial norm (which would silently change the
clipping threshold)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_mesh

import zeroshard as zs


def sliced_tree(rng) -> dict:
    """Leaves whose first axis splits over 8 devices, of unequal sizes and scales."""
    f = lambda scale, *shape: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    return {"a": f(1.0, 64), "b": f(3.0, 8, 3), "c": {"d": f(0.1, 16, 5)}}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("fraction", [0.5, 2.0], ids=["clips", "passes"])
def test_global_norm_and_clipping_in_a_plain_shard_map(fraction, check_vma, rng):
    """Every device's norm is the one-device norm of the whole tree, and the clipped
    slices put together are optax's clip of the whole tree."""
    mesh, tree = make_mesh(8), sliced_tree(rng)
    expected_norm = np.sqrt(
        sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(tree))
    )
    max_norm = fraction * expected_norm
    clip = zs.clip_by_global_norm(max_norm, axis_name="data")

    def local(t):
        norm = zs.global_norm(t, "data")
        clipped, _ = clip.update(t, clip.init(t))
        return norm.reshape(1), clipped  # one norm per device: each is compared

    spec = jax.P("data")
    norms, clipped = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(spec, spec), check_vma=check_vma)
    )(jax.device_put(tree, jax.NamedSharding(mesh, spec)))
    np.testing.assert_allclose(np.asarray(norms), np.full(8, expected_norm), rtol=1e-6)
    reference = optax.clip_by_global_norm(max_norm)
    expected, _ = reference.update(tree, reference.init(tree))
    flat = jax.tree_util.tree_leaves_with_path(clipped)
    for (path, a), e in zip(flat, jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=0, err_msg=jax.tree_util.keystr(path))
    assert np.array_equal(clipped["a"], tree["a"]) == (fraction > 1)
