"""Models and the independent reference: plain optax on one device on the global batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def make_mesh(n: int, axis_name: str = "data") -> jax.sharding.Mesh:
    """A 1-D mesh over the first ``n`` simulated devices."""
    return jax.make_mesh((n,), (axis_name,), devices=jax.devices()[:n])


def awkward_params(rng: np.random.Generator, small_dtype=jnp.float32) -> dict:
    """A scalar, sizes prime to every N, many small leaves; ``small` leaves in ``small_dtype``."""
    f = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)
    return {
        "scale": jnp.float32(0.9),
        "dense": {"w": f(7, 13), "b": f(13)},
        "small": [f(5).astype(small_dtype) for _ in range(11)],
        "out": {"w": f(13, 5)},
    }


def awkward_loss(params: dict, batch: dict) -> jax.Array:
    p = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    h = jnp.tanh(batch["x"] @ p["dense"]["w"] + p["dense"]["b"]) * p["scale"]
    out = h @ p["out"]["w"] + sum((i + 1) / 10 * s for i, s in enumerate(p["small"]))
    return jnp.mean((out - batch["y"]) ** 2)


def batches(rng: np.random.Generator, steps: int, size: int = 16) -> list[dict]:
    return [
        {
            "x": jnp.asarray(rng.normal(size=(size, 7)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(size, 5)), jnp.float32),
        }
        for _ in range(steps)
    ]


def reference_run(loss_fn, inner, params, data, compute_dtypes=None, num_devices=1):
    """Plain optax on one device.

    With ``compute_dtypes`` (a dtype, or a tree of them) it keeps an fp32 master of
    ``params`` and runs forward/backward on a copy cast to the compute dtypes. With
    ``num_devices`` > 1 it takes the gradient of each of that many equal parts of the
    batch in the compute dtype and averages them in fp32: the rounding that
    data-parallel training in a low-precision compute dtype does by definition.
    """
    if compute_dtypes is not None and not isinstance(compute_dtypes, dict):
        compute_dtypes = jax.tree.map(lambda _: compute_dtypes, params)
    if compute_dtypes is not None:
        params = jax.tree.map(lambda x: x.astype(jnp.float32), params)

    def mean_grad(compute, batch):
        parts = [
            jax.tree.map(lambda x, i=i: jnp.split(x, num_devices)[i], batch)
            for i in range(num_devices)
        ]
        grads = [jax.grad(loss_fn)(compute, part) for part in parts]
        grads = [jax.tree.map(lambda g: g.astype(jnp.float32), g) for g in grads]
        return jax.tree.map(lambda *gs: sum(gs) / num_devices, *grads)

    @jax.jit
    def step(master, opt_state, batch):
        compute = master
        if compute_dtypes is not None:
            compute = jax.tree.map(lambda x, d: x.astype(d), master, compute_dtypes)
        grads = mean_grad(compute, batch) if num_devices > 1 else jax.grad(loss_fn)(compute, batch)
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
        updates, opt_state = inner.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    opt_state = inner.init(params)
    for batch in data:
        params, opt_state = step(params, opt_state, batch)
    return params


def assert_trees_close(actual, expected, rtol: float) -> None:
    """Elementwise ``|a - e| <= rtol * max|e|`` per leaf (relative to the leaf's scale)."""
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        a = np.asarray(a, np.float64)
        e = np.asarray(e, np.float64)
        assert a.shape == e.shape, jax.tree_util.keystr(path)
        scale = max(np.max(np.abs(e)), 1e-30)
        np.testing.assert_allclose(
            a, e, rtol=0, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
        )


def assert_within_bf16_rounding(actual, expected, initial) -> None:
    """For fp32 masters trained on bf16 gradients: each device's gradient is rounded
    to bf16 once, and a different summation order can move that rounding by one bf16
    ulp (2^-8 relative). The master's displacement may differ by that much."""
    for (path, a), e, i in zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree.leaves(expected),
        jax.tree.leaves(initial),
        strict=True,
    ):
        a, e, i = (np.asarray(x, np.float64) for x in (a, e, i))
        movement = np.max(np.abs(e - i))
        assert movement > 0, jax.tree_util.keystr(path)
        assert np.max(np.abs(a - e)) <= 2**-7 * movement + 1e-7, jax.tree_util.keystr(path)


def layered_params(rng: np.random.Generator, layers: int = 4, width: int = 256) -> dict:
    """A stack of ``layers`` dense ``width`` x ``width`` layers."""
    f = lambda *s: jnp.asarray(rng.normal(size=s) / s[0] ** 0.5, jnp.float32)
    return {f"l{i}": {"w": f(width, width), "b": jnp.zeros(width)} for i in range(layers)}


def layered_loss(params: dict, batch: dict, stage: int = 1) -> jax.Array:
    """The stack's loss; with ``stage=3`` each layer gathers its pieces (zs.layer)."""
    import zeroshard as zs

    dense = lambda p, x: jnp.tanh(x @ p["w"] + p["b"])
    apply = zs.layer(dense) if stage == 3 else dense
    x = batch["x"]
    for p in params.values():
        x = apply(p, x)
    return jnp.mean((x - batch["y"]) ** 2)


# A gradient with one non-finite element, in one device's piece only.


def one_piece_params(rng) -> dict:
    """``w``: 64 fp32 elements, on 8 devices pieces of 8 (device ``d`` owns elements
    ``8d`` to ``8d + 7``); ``m``: a second leaf whose gradient stays finite."""
    return {
        "w": jnp.asarray(rng.normal(size=64), jnp.float32),
        "m": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
    }


def one_piece_loss(p: dict, batch: dict) -> jax.Array:
    """The mean gradient of ``w`` is the batch mean of ``c``: one element per column."""
    w, m = p["w"].astype(jnp.float32), p["m"].astype(jnp.float32)
    return jnp.mean(batch["c"] @ w) + jnp.mean((batch["x"] @ m) ** 2)


def one_piece_batch(rng, row: int | None = None, column: int | None = None) -> dict:
    """16 rows; with ``row``, ``c[row, column]`` is +inf: then the mean gradient's only
    non-finite element is ``w[column]``, in the piece of device ``column // 8``."""
    c = rng.normal(size=(16, 64)).astype(np.float32)
    if row is not None:
        c[row, column] = np.inf
    return {"c": c, "x": rng.normal(size=(16, 7)).astype(np.float32)}


def shards(tree) -> dict:
    """Every device's data of every leaf, by (leaf path, device)."""
    return {
        (jax.tree_util.keystr(path), s.device.id): np.array(s.data)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        for s in leaf.addressable_shards
    }


# Row 0 is device 0's and element 45 in device 5's piece; then row 15 (device 7's) and
# element 2 (device 0's piece): a verdict read from any one device misses one of them.
BAD_ELEMENTS = [(0, 45), (15, 2)]


def assert_skipped_everywhere(before: dict, after: dict, skips: int) -> None:
    """``after`` (see :func:`shards`) counts ``skips`` skipped steps on every device,
    and every device's weights and optimizer state are bitwise those of ``before``."""
    for (path, device), x in after.items():
        if path.endswith("skipped"):
            assert x == skips, f"device {device} counted {x} skipped steps, not {skips}"
    for (path, device), x in after.items():
        if path.endswith("loss_scale.scale"):  # the overflow halves it everywhere
            assert x == before[path, device] / 2, f"device {device}"
        elif not path.endswith(("step", "skipped", "grad_norm", "good_steps")):
            np.testing.assert_array_equal(x, before[path, device], err_msg=f"{path} {device}")


def check_one_piece_batch(params: dict, batch: dict, column: int) -> None:
    """The mean gradient's only non-finite element is ``w[column]``."""
    grad = jax.grad(one_piece_loss)(params, batch)
    bad = [(k, i) for k, g in grad.items() for i in np.flatnonzero(~np.isfinite(g))]
    assert bad == [("w", column)]


def per_device_bytes(tree) -> dict:
    """Bytes of ``tree``'s arrays on each device."""
    held = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def stage3_bytes(
    tree, explicit: bool, stacked: tuple[str, ...] = ("blocks",), devices: int = 8
) -> float:
    """Bytes per device of the weights ``tree`` at stage 3 in your own ``jax.jit`` on
    ``devices`` devices: 1/N of each leaf (a ``zs.Piece``'s pieces: of its padded size), but, on
    Explicit axes, a leaf of one dimension per layer (a bias, a norm's scale; leaves
    under a key in ``stacked`` have one layer axis) whole: model code reads those
    with the activations, as they are."""
    total = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        layers = any(getattr(k, "key", None) in stacked for k in path)
        piece = any(isinstance(k, jax.tree_util.FlattenedIndexKey) for k in path)
        whole = explicit and x.ndim - layers <= 1 and not piece
        total += x.nbytes if whole else x.nbytes / devices
    return total
