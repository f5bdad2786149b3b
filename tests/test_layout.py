"""Layout: full leaves <-> per-device rows of dtype buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroshard.communication.stage3 import piece_blocks, piece_from_owners
from zeroshard.core.layout import WHOLE, Layout, Slot, Split


def tree(rng):
    return {
        "scalar": jnp.float32(3.0),
        "prime": jnp.asarray(rng.normal(size=(7, 13)), jnp.float32),
        "half": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
        "many": [jnp.asarray(rng.normal(size=(3,)), jnp.float32) for _ in range(9)],
        "empty": jnp.zeros((0, 4), jnp.float32),
    }


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_pieces_rows_and_padding(n, rng):
    t = tree(rng)
    layout = Layout.from_tree(t, n)
    assert [b.dtype for b in layout.buckets] == [jnp.float32, jnp.bfloat16]
    per_device = [layout.pieces(t, d) for d in range(n)]
    for i, (leaf, slot) in enumerate(zip(jax.tree.leaves(t), layout.slots, strict=True)):
        blocks = np.concatenate([np.asarray(p[i]) for p in per_device])
        assert blocks.shape == (n * slot.piece_size,) and blocks.dtype == leaf.dtype
        assert 0 <= blocks.size - leaf.size < n  # less than n padding elements per leaf
        np.testing.assert_array_equal(blocks[: leaf.size].reshape(leaf.shape), leaf)
        assert not blocks[leaf.size :].any()  # padding is zero
    for b in layout.buckets:
        assert b.row_size == sum(layout.slots[i].piece_size for i in b.slots)
    for piece, slot in zip(
        jax.tree.leaves(layout.full_structs(pieces=True)), layout.slots, strict=True
    ):
        assert piece.shape == slot.piece_shape and piece.size == slot.piece_size
        assert piece.ndim == max(len(slot.shape), 1)  # the leaf's rank, scalars 1


@pytest.mark.parametrize("n", [1, 3, 8])
def test_owned_leaves_are_balanced_and_round_trip(n, rng):
    t = tree(rng)
    names = [s.path for s in Layout.from_tree(t, n).slots]
    owned = {names.index("['prime']"): 91.0, names.index("['half']"): 5.0}
    owned |= {names.index(f"['many'][{k}]"): 3.0 for k in range(9)}
    layout = Layout.from_tree(t, n, owned=owned)
    slots = layout.slots
    assert {i for i, s in enumerate(slots) if s.placement == "owned"} == set(owned)
    assert slots[names.index("['prime']")].owner == 0  # the largest goes first
    load = [sum(owned[i] for i in layout.owned_by(d)) for d in range(n)]
    assert max(load) - min(load) <= max(owned.values())  # greedy: within one leaf
    leaves = jax.tree.leaves(t)
    for b, bucket in enumerate(layout.buckets):
        blocks = layout.owned_blocks(leaves, b, bucket.dtype)
        assert blocks.shape == (n, bucket.owned_width)
        for i in (i for i in bucket.slots if slots[i].owned):
            np.testing.assert_array_equal(layout.owned_full(blocks, i), leaves[i])
            owner = slots[i].owner
            np.testing.assert_array_equal(layout.owned_local(blocks[owner], i, owner), leaves[i])
        sliced = [i for i in bucket.slots if not slots[i].owned]
        assert bucket.row_size == sum(slots[i].piece_size for i in sliced)
    assert all(p is None for p, s in zip(layout.pieces(t, 0), slots, strict=True) if s.owned)


@pytest.mark.parametrize("n", [3, 4])
def test_layer_owned_leaves_spread_their_layers_and_round_trip(n, rng):
    """Each layer of a layer-owned leaf is a unit placed like a whole leaf: 7 layers of
    cost 4 and one whole leaf of cost 10 over n devices, largest first."""
    t = {"stack": jnp.asarray(rng.normal(size=(7, 3, 5)), jnp.float32), "w": jnp.ones((4, 6))}
    names = [s.path for s in Layout.from_tree(t, n).slots]
    stack, w = names.index("['stack']"), names.index("['w']")
    layout = Layout.from_tree(t, n, owned={stack: 28.0, w: 10.0}, layered={stack})
    s = layout.slots[stack]
    assert s.placement == "layer-owned" and layout.slots[w].placement == "owned"
    assert layout.slots[w].owner == 0  # cost 10 first, then the layers (cost 4 each)
    load = [4.0 * len(s.units_of(d)) + 10.0 * (d == 0) for d in range(n)]
    assert max(load) - min(load) <= 10.0
    leaves = jax.tree.leaves(t)
    blocks = layout.owned_blocks(leaves, 0, jnp.float32)
    np.testing.assert_array_equal(layout.owned_full(blocks, stack), leaves[stack])
    for d in (d for d in range(n) if d in s.owners):
        units = np.asarray(s.units_of(d))
        mine = np.asarray(leaves[stack])[units]
        np.testing.assert_array_equal(s.local(leaves[stack], d), mine)
        np.testing.assert_array_equal(layout.owned_local(blocks[d], stack, d), mine)
        np.testing.assert_array_equal(s.local(leaves[stack], jnp.int32(d), len(units)), mine)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_stage3_pieces_go_to_their_owners_and_back(n, rng):
    """Stage 3 keeps owned leaves as pieces too: each device's pieces of the units a
    device owns reach it (one all_to_all, simulated here), which puts the units back
    together; and the owners' units return as every device's pieces."""
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    t = {"stack": f(5, 3, 7), "w": f(4, 6), "b": f(9), "stacked_whole": f(2, 5, 3)}
    dims = lambda path, leaf: int("stack" in path)
    names = [s.path for s in Layout.from_tree(t, n, dims).slots]
    index = {name[2:-2]: k for k, name in enumerate(names)}
    owned = {index["stack"]: 20.0, index["w"]: 8.0, index["stacked_whole"]: 4.0}
    layout = Layout.from_tree(t, n, dims, owned=owned, layered={index["stack"]})
    leaves = jax.tree.leaves(t)
    sent = [  # per device: (num_shards, owned_chunk), row d for device d
        layout.owned_blocks(
            [s.cut(x, d) for x, s in zip(leaves, layout.slots, strict=True)], 0, jnp.float32, True
        )
        for d in range(n)
    ]
    back = []
    for o in range(n):
        received = jnp.stack([sent[d][o] for d in range(n)])
        local = [None] * len(leaves)
        for i in (i for i in owned if o in layout.slots[i].owners):
            local[i] = layout.owned_local(received, i, o, pieces=True)
            np.testing.assert_array_equal(local[i], layout.slots[i].local(leaves[i], o))
        back.append(piece_blocks(layout, local, o, 0, jnp.float32))
    for d in range(n):
        received = jnp.stack([back[o][d] for o in range(n)])
        for i in owned:
            s = layout.slots[i]
            np.testing.assert_array_equal(
                piece_from_owners(layout, received, i), s.cut(leaves[i], d)
            )


def test_groups_pack_small_leaves_per_dtype_up_to_the_limit():
    t = {
        "a": jnp.zeros(300, jnp.float32),  # 1,200 B
        "b": jnp.zeros(10, jnp.float32),
        "c": jnp.zeros(700, jnp.bfloat16),  # 1,400 B
        "d": jnp.zeros(200, jnp.float32),  # 800 B
        "e": jnp.zeros(3, jnp.bfloat16),
    }
    layout = Layout.from_tree(t, 4)
    names = [s.path for s in layout.slots]
    named = lambda groups: [[names[i] for i in g] for g in groups]
    assert named(layout.groups(1000)) == [["['b']", "['d']"], ["['a']"], ["['e']"], ["['c']"]]
    assert named(layout.groups(820)) == [["['b']"], ["['d']"], ["['a']"], ["['e']"], ["['c']"]]
    assert named(layout.groups(0)) == [[n] for n in ("['a']", "['b']", "['d']", "['c']", "['e']")]
    assert named(layout.groups(1 << 20)) == [["['a']", "['b']", "['d']"], ["['c']", "['e']"]]
    for limit in (1000, 0):
        widths = [(4, [layout.slots[i].piece_size for i in g]) for g in layout.groups(limit)]
        assert layout.collective_widths(limit) == widths  # (no owned leaves, none split)


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


@pytest.mark.parametrize("dim,data", [(1, 3), (1, 4), (0, 4)])
def test_a_split_leaf_is_cut_block_by_block(dim, data):
    """Megatron's rule (a leaf split over "model" in 2 blocks): device (d, m), index
    2 d + m over the state's axes, holds piece d of block m, cut over the data devices
    alone, padded within the block; the pieces put back together give the leaf."""
    x = jnp.arange(6 * 10, dtype=jnp.float32).reshape(6, 10)
    split = Split(dim, ("model",), 2, ("data",))
    slot = Layout.from_tree({"w": x}, 2 * data, splits={0: split}).slots[0]
    blocks = np.split(np.asarray(x), 2, axis=dim)
    width = -(-blocks[0].size // data)
    assert slot.piece_shape == (1, width)
    rows = np.asarray(slot.blocks(x))
    for index in range(2 * data):
        d, m = divmod(index, 2)
        padded = np.pad(blocks[m].ravel(), (0, data * width - blocks[m].size))
        piece = padded[d * width : (d + 1) * width]
        np.testing.assert_array_equal(rows[index], piece)
        np.testing.assert_array_equal(slot.cut(x, index), piece)
        np.testing.assert_array_equal(slot.own(jnp.asarray(blocks[m]), index), piece)
        mine = np.arange(width) + d * width < blocks[m].size
        np.testing.assert_array_equal(slot.padding_mask(index), mine)
    np.testing.assert_array_equal(slot.uncut(jnp.asarray(rows)), x)
    assert slot.piece_spec(("data", "model")) == jax.sharding.PartitionSpec("model", "data")


def test_only_leaves_cut_evenly_by_blocks_are_split():
    """A vector, a dimension that the blocks do not divide, or a layer axis: gathered
    whole for the update (no split)."""
    split = Split(0, ("model",), 2, ("data",))
    tree = {"v": jnp.zeros(8), "odd": jnp.zeros((3, 4)), "w": jnp.zeros((4, 4))}
    layout = Layout.from_tree(tree, 8, splits={0: split, 1: split, 2: split})
    assert [s.split for s in layout.slots] == [WHOLE, WHOLE, split]
    stacked = Layout.from_tree({"w": jnp.zeros((4, 4, 4))}, 8, ["w"], splits={0: split})
    assert stacked.slots[0].split == WHOLE


@pytest.mark.parametrize("shape", [(8, 4), (1, 16), (7, 3), (3, 5, 3)])
def test_pieces_in_order_are_cut_and_joined_by_one_reshape(shape):
    """An unpadded leaf of one layer: every device's piece in device order is the leaf
    raveled, so cutting it into its pieces (``blocks``) and joining them (``uncut``)
    each trace at most one reshape (stage 3 traces the join again per layer in the backward
    pass); a padded or stacked leaf keeps its padding and transposes. Both round-trip."""
    stacked = int(len(shape) == 3)
    slot = Slot.of(shape, np.float32, 8, stacked)
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    rows = slot.blocks(x)
    # (at most one reshape: none where the leaf is shaped as its rows already)
    one = lambda f, a: [e.primitive.name for e in jax.make_jaxpr(f)(a).eqns] in ([], ["reshape"])
    in_order = shape[-1] * shape[-2] % 8 == 0 and not stacked
    assert one(slot.blocks, x) == in_order
    assert one(slot.uncut, rows) == in_order
    np.testing.assert_array_equal(slot.uncut(rows), x)
