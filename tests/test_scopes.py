"""Named scopes: zeroshard's collectives and its update carry their own names in the
compiled program (the HLO ``op_name`` metadata a profiler shows), and change no bit."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, make_mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
from zeroshard.measuring import scopes
from zeroshard.measuring.scopes import SCOPES, scopes_of

_OP_NAME = re.compile(r'op_name="([^"]*)"')


@pytest.fixture(autouse=True)
def metadata_in_the_cache_key():
    """A compilation-cache hit here is the same program down to its op names: these
    tests compile steps with the scopes and without them (the same HLO but for its
    metadata), and read the names. Elsewhere the suite keys programs as jax does by
    default, without their metadata (tests/conftest.py)."""
    option = "jax_compilation_cache_include_metadata_in_key"
    before = getattr(jax.config, option)
    jax.config.update(option, True)
    yield
    jax.config.update(option, before)


def op_scopes(hlo_text: str) -> set[str]:
    """Every zeroshard scope some instruction of a compiled program is named in."""
    return {s for name in _OP_NAME.findall(hlo_text) for s in scopes_of(name)}


def collective_scopes(hlo_text: str, mesh=None) -> dict[str, set[str]]:
    """Per collective kind, the zeroshard scopes its instructions are named in; a
    collective outside every scope counts as ``"-"``."""
    out: dict[str, set[str]] = {}
    for c in zs.compiled_collectives(hlo_text, mesh=mesh):
        out.setdefault(c.kind, set()).update(scopes_of(c.op_name) or {"-"})
    return out


def owned_dense(path, leaf):
    """One leaf owned (its update on one device), the others sliced: both paths run."""
    return "owned" if jax.tree_util.keystr(path) == "['out']['w']" else None


def inner():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def compiled_step(rng, stage=1, mesh=None, **options):
    mesh = mesh or make_mesh(8)
    tx = zs.sharded(inner(), placement=owned_dense, **options)
    params = awkward_params(rng)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
    loss_fn = awkward_loss if stage < 3 else lambda p, b: awkward_loss(zs.gather(p), b)
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    return step.lower(state, batches(rng, 1)[0]).compile().as_text()


def test_scopes_of_reads_plain_merged_and_transposed_names():
    assert scopes_of("jit(f)/shard_map/zeroshard/all_gather/all_gather_invariant") == (
        "all_gather",
    )
    assert scopes_of("jit(f)/shard_map/zeroshard/(grad_norm/psum:metrics/psum)") == (
        "grad_norm",
        "metrics",
    )
    assert scopes_of("jit(f)/shard_map/transpose(jvp(zeroshard/gather))/reduce_scatter") == (
        "gather",
    )
    assert scopes_of("jit(f)/shard_map/jvp(dense)/dot_general") == ()
    assert scopes_of("jit(f)/zeroshard/not_a_scope/add") == ()


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_every_collective_of_a_stage_1_step_is_in_its_scope(accum_steps, rng):
    """Reduce-scatter, gradient norm, update, all-gather: each collective is named for
    the part of the flow it belongs to (the all-reduces of the norm and the loss may be
    merged into one by the compiler; clipping's sum and the owned leaves' state run in
    the update)."""
    mesh, tx = make_mesh(8), zs.sharded(inner(), placement=owned_dense)
    params = awkward_params(rng)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16)
    step = zs.make_train_step(awkward_loss, tx, mesh, accum_steps=accum_steps)
    text = step.lower(state, batches(rng, 1)[0]).compile().as_text()
    found = collective_scopes(text)
    assert found["reduce-scatter"] == {"reduce_scatter"}
    assert "all_gather" in found["all-gather"] <= {"all_gather", "update"}
    assert "grad_norm" in found["all-reduce"] <= {"grad_norm", "metrics", "update"}
    assert {"reduce_scatter", "grad_norm", "update", "all_gather", "metrics"} <= op_scopes(text)


def test_stage_3_gathers_exchanges_and_update_are_named(rng):
    """Stage 3: the layer gathers and, in the backward pass, their transposes (the
    gradients' reduce-scatter), the owned leaf's exchanges to and from its owner."""
    text = compiled_step(rng, stage=3)
    found = collective_scopes(text)
    assert found["reduce-scatter"] == {"gather"}  # transpose(jvp(zeroshard/gather))
    assert "gather" in found["all-gather"] <= {"gather", "update"}
    assert "grad_norm" in found["all-reduce"] <= {"grad_norm", "metrics", "update"}
    expected = {"gather", "reduce_scatter", "to_owners", "grad_norm", "update", "from_owners"}
    assert expected <= op_scopes(text)
    assert "all_gather" not in op_scopes(text)  # stage 3 ends with pieces


def test_the_replica_mean_is_named(rng):
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    text = compiled_step(rng, mesh=mesh, replica_axis="replica")
    over = {}
    for c in zs.compiled_collectives(text, mesh=mesh):
        over.setdefault(c.axes, set()).update(scopes_of(c.op_name) or {"-"})
    assert "replica_mean" in over[("replica",)] <= {"replica_mean", "update"}
    assert over[("data",)] >= {"reduce_scatter", "grad_norm", "all_gather"}


def test_the_drop_in_update_in_a_user_jit_step_is_named(rng):
    """``tx.update`` in the user's own ``jax.jit``: the user's reduction of the
    gradient is theirs (no zeroshard scope); the cut, the update and the all-gather of
    the new weights are named."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tx = zs.sharded(inner(), placement=owned_dense)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(awkward_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.set_mesh(mesh):
        params = jax.device_put(awkward_params(rng), NamedSharding(mesh, P()))
        opt_state = tx.init(params)
        batch = jax.device_put(batches(rng, 1)[0], P("data"))
        text = step.lower(params, opt_state, batch).compile().as_text()
    assert {"cut", "grad_norm", "update", "all_gather"} <= op_scopes(text)
    assert "all_gather" in collective_scopes(text)["all-gather"]
    assert "reduce_scatter" not in op_scopes(text)


def test_every_scope_is_documented():
    for name in SCOPES:
        assert f"``zeroshard/{name}``" in scopes.__doc__, name


@pytest.mark.parametrize("stage", [1, 3])
def test_scopes_change_no_bit(stage, rng, monkeypatch):
    """The same steps traced with the scopes as no-ops give bitwise the same state."""
    mesh, params, data = make_mesh(8), awkward_params(rng), batches(rng, 2)
    tx = zs.sharded(inner(), placement=owned_dense)
    loss_fn = awkward_loss if stage < 3 else lambda p, b: awkward_loss(zs.gather(p), b)

    def train():
        state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
        step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
        text = step.lower(state, data[0]).compile().as_text()
        for batch in data:
            state, metrics = step(state, batch)
        return (state, metrics), op_scopes(text)

    named, found = train()
    assert "update" in found
    monkeypatch.setattr(jax, "named_scope", lambda name: contextlib.nullcontext())
    plain, found = train()
    assert found == set()
    for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
