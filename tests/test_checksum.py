"""Checksums of logical leaves: the same on any device count and split, on device."""

import jax
import jax.numpy as jnp
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
from zeroshard.checkpointing.logical import logical_spec


def leaves(rng):
    return {
        "rows": jnp.asarray(rng.normal(size=(24, 5)), jnp.float32),  # splits on dim 0
        "cols": jnp.asarray(rng.normal(size=(5, 48)), jnp.bfloat16),  # on dim 1
        "odd": jnp.asarray(rng.normal(size=(7, 11)), jnp.float32),  # never: replicated
        "count": jnp.int32(17),
        "mask": jnp.asarray(rng.random(size=(16,)) > 0.5),
    }


def on(tree, n):
    mesh = make_mesh(n)
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, logical_spec(x.shape, n, "data"))), tree
    )


def test_the_same_on_1_3_and_8_devices(rng):
    tree = leaves(rng)
    expected = zs.checksums(tree)  # one device, the whole array
    for n in (1, 3, 8):
        placed = on(tree, n)
        if n > 1:  # each device really holds only its block
            assert placed["rows"].sharding.spec == P("data")
            assert placed["cols"].sharding.spec == P(None, "data")
        assert zs.checksums(placed) == expected, n
    # Split over two mesh axes at once, and replicated over one of them.
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    both = jax.device_put(tree["rows"], NamedSharding(mesh, P(("replica", "data"))))
    one = jax.device_put(tree["cols"], NamedSharding(mesh, P(None, "data")))
    assert zs.checksums([both, one]) == [expected["rows"], expected["cols"]]


def test_replicated_leaves_count_once(rng):
    x = jnp.asarray(rng.normal(size=(7, 11)), jnp.float32)
    replicated = jax.device_put(x, NamedSharding(make_mesh(8), P()))
    assert zs.checksums(replicated) == zs.checksums(x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint16])
def test_any_single_element_change_is_seen(rng, dtype):
    x = jnp.asarray(rng.normal(size=(16, 6)) * 50, dtype)
    before = zs.checksums(on(x, 8))
    for index in [(0, 0), (7, 3), (15, 5)]:
        changed = x.at[index].set(x[index] + jnp.asarray(1, dtype))
        assert zs.checksums(on(changed, 8)) != before
    # Moving values between positions changes it too (the sum is position-weighted).
    swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
    assert bool(x[0, 0] != x[0, 1]) and zs.checksums(on(swapped, 8)) != before


def test_values_are_32_bit_and_computed_without_gathering(rng):
    tree = on(leaves(rng), 8)
    sums = zs.checksums(tree)
    assert all(isinstance(v, int) and 0 <= v < 2**32 for v in jax.tree.leaves(sums))
    from zeroshard.checkpointing.integrity import checksum_program

    arrays = jax.tree.leaves(tree)
    hlo = checksum_program(make_mesh(8)).lower(*arrays).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo
