"""Layout: full leaves <-> per-device rows of dtype buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroshard.layout import Layout


def tree(rng):
    return {
        "scalar": jnp.float32(3.0),
        "prime": jnp.asarray(rng.normal(size=(7, 13)), jnp.float32),
        "half": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
        "many": [jnp.asarray(rng.normal(size=(3,)), jnp.float32) for _ in range(9)],
        "empty": jnp.zeros((0, 4), jnp.float32),
    }


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_pack_unpack_round_trip(n, rng):
    t = tree(rng)
    layout = Layout.from_tree(t, n)
    back = layout.unpack(layout.pack(t))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(t), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_rows_split_join_and_padding(n, rng):
    t = tree(rng)
    layout = Layout.from_tree(t, n)
    assert [b.dtype for b in layout.buckets] == [jnp.float32, jnp.bfloat16]
    matrices = layout.pack(t)
    for b, bucket in enumerate(layout.buckets):
        assert matrices[b].shape == (n, bucket.row_size)
        # Less than n padding elements per leaf.
        real = sum(layout.slots[i].size for i in bucket.slots)
        assert 0 <= n * bucket.row_size - real < n * len(bucket.slots)
        # Padding is zero: the matrix sums to the leaves' sum.
        leaves = jax.tree.leaves(t)
        total = sum(float(jnp.sum(leaves[i].astype(jnp.float32))) for i in bucket.slots)
        np.testing.assert_allclose(
            float(jnp.sum(matrices[b].astype(jnp.float32))), total, rtol=1e-5
        )
    for d in range(n):
        rows = [layout.row(t, d, b) for b in range(len(layout.buckets))]
        for row, m in zip(rows, matrices, strict=True):
            np.testing.assert_array_equal(row, m[d])
        pieces = layout.split(rows)
        for piece, slot in zip(jax.tree.leaves(pieces), layout.slots, strict=True):
            assert piece.shape == layout.piece_shape(slot)
            assert piece.ndim == max(len(slot.shape), 1)  # the leaf's rank, scalars 1
        for a, b in zip(layout.join(pieces), rows, strict=True):
            np.testing.assert_array_equal(a, b)


def test_layout_is_static_and_hashable(rng):
    t = tree(rng)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    assert Layout.from_tree(t, 4) == Layout.from_tree(structs, 4)
    assert hash(Layout.from_tree(t, 4)) == hash(Layout.from_tree(structs, 4))
    assert Layout.from_tree(t, 4) != Layout.from_tree(t, 8)


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        Layout.from_tree([], 2)
    with pytest.raises(TypeError, match="floating-point"):
        Layout.from_tree({"n": jnp.arange(3)}, 2)
    layout = Layout.from_tree({"w": jnp.ones((2, 3))}, 2)
    with pytest.raises(ValueError, match=r"grads leaf \['w'\] has shape \(3, 2\)"):
        layout.check_matches({"w": jnp.ones((3, 2))}, "grads")
