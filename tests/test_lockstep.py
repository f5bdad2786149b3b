"""Lockstep: no collective inside a conditional whose branch is the device's own, so
every device meets every collective in one order (on jax 0.12's CPU runtime a
``psum`` in the owner's branch and its twin in the other devices' branch never met:
the step hung until the rendezvous timeout aborted the process)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, batches, make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeroshard as zs
from zeroshard.core import lockstep

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_BRANCHES = re.compile(
    r"branch_computations=\{([^}]*)\}|true_computation=%(\S+), false_computation=%(\S+)"
)
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.-]+)")
_COLLECTIVE = re.compile(
    r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
)


def computations(hlo: str) -> dict[str, list[str]]:
    """The compiled program's computations, by name: their instruction lines."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(1)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def collectives_in_branches(hlo: str) -> list[str]:
    """The collectives of every computation a conditional runs as a branch (and of
    what those call, nested conditionals' branches included)."""
    comps, seen, found = computations(hlo), set(), []
    todo = [
        n
        for lines in comps.values()
        for line in lines
        for m in _BRANCHES.finditer(line)
        for n in re.findall(r"%?([\w.-]+)", m.group(1) or f"{m.group(2)} {m.group(3)}")
    ]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            found += [f"{name}: {m.group(1)}" for m in [_COLLECTIVE.search(line)] if m]
            todo += _CALLS.findall(line)
            for m in _BRANCHES.finditer(line):
                todo += re.findall(r"%?([\w.-]+)", m.group(1) or f"{m.group(2)} {m.group(3)}")
    return found


def owned_dense(path, leaf):
    """One leaf owned (its update on one device): two branches, owner and others."""
    return "owned" if jax.tree_util.keystr(path) == "['out']['w']" else None


INNERS = {
    "clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),  # per-leaf norms: sums that wait on sums
}


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_no_collective_runs_inside_a_devices_branch(inner, stage, rng):
    """The step of an owned leaf whose update sums across devices (a global norm; LAMB's
    norms): every collective of the compiled program is outside the conditionals."""
    mesh, tx = make_mesh(8), zs.sharded(INNERS[inner](), placement=owned_dense)
    params = awkward_params(rng)
    state = zs.init_train_state(params, tx, mesh, param_dtype=jnp.bfloat16, stage=stage)
    loss_fn = awkward_loss if stage < 3 else lambda p, b: awkward_loss(zs.gather(p), b)
    step = zs.make_train_step(loss_fn, tx, mesh, stage=stage)
    hlo = step.lower(state, batches(rng, 1)[0]).compile().as_text()
    assert "conditional(" in hlo  # (the owner's branch and the others')
    assert collectives_in_branches(hlo) == []
    assert "all-reduce(" in hlo


def _device_switch(branches, x, mesh, hlo=False, run=True):
    """``lockstep.switch`` in a ``shard_map``: device 0 takes branch 1, the others 0
    (with ``hlo``, also the compiled program's text; without ``run``, only that)."""

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def f(x):
        index = (jax.lax.axis_index("data") == 0).astype(jnp.int32)
        return lockstep.switch(index, branches, x)

    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    if hlo:
        text = f.lower(x).compile().as_text()
        return (f(x) if run else None), text
    return f(x)


def test_switch_pairs_the_branches_collectives_in_order():
    """Two branches, each a ``psum`` that the next ``psum`` waits on, inside a nested
    conditional too: the k-th collective of each branch meet, as if in one branch."""
    mesh = make_mesh(8)

    def branch(scale):
        def run(x):
            total = jax.lax.psum(scale * x, "data")  # level 0
            twice = jax.lax.cond(total[0] > 0, lambda t: 2 * t, lambda t: -t, total)
            summed = lambda y: jax.lax.pcast(jax.lax.psum(y * twice, "data"), "data", to="varying")
            after = jax.lax.cond(jnp.sum(x) > -1, summed, lambda y: y, x)  # level 1, nested
            return after + total

        return run

    x = jnp.arange(1.0, 9.0)
    out, hlo = _device_switch([branch(1.0), branch(3.0)], x, mesh, hlo=True)
    xs = np.arange(1.0, 9.0)
    scale = np.where(np.arange(8) == 0, 3.0, 1.0)
    total = np.sum(scale * xs)
    expected = np.sum(xs * 2 * total) + total
    np.testing.assert_allclose(np.asarray(out), np.full(8, expected), rtol=1e-6)
    assert collectives_in_branches(hlo) == [] and hlo.count("all-reduce(") == 2


def test_switch_takes_collectives_out_of_loops():
    """A ``psum`` inside a ``fori_loop`` of concrete bounds (a ``scan``: Muon's
    Newton-Schulz iteration over a blocked leaf) and inside a reversed ``scan`` with
    stacked outputs: the loops are unrolled, every collective runs outside the
    conditionals (checked on the compiled program before it runs: the old code's
    program hangs on jax 0.12.1), and the numbers are the loops'."""
    mesh = make_mesh(8)

    def branch(scale):
        def run(x):
            c = jax.lax.fori_loop(0, 3, lambda i, c: c + 0.1 * jax.lax.psum(scale * c, "data"), x)

            def body(carry, r):
                s = jax.lax.psum(carry * r, "data")
                return carry + 0.01 * s, s

            c, ys = jax.lax.scan(body, c, jnp.arange(1.0, 3.0), reverse=True)
            return c + ys[0] - ys[1]

        return run

    x = jnp.arange(1.0, 9.0)
    _, hlo = _device_switch([branch(1.0), branch(3.0)], x, mesh, hlo=True, run=False)
    assert collectives_in_branches(hlo) == [] and "all-reduce(" in hlo
    out = _device_switch([branch(1.0), branch(3.0)], x, mesh)
    c, scale = np.arange(1.0, 9.0), np.where(np.arange(8) == 0, 3.0, 1.0)
    for _ in range(3):
        c = c + 0.1 * np.sum(scale * c)
    ys = [0.0, 0.0]
    for i in (1, 0):  # reversed
        ys[i] = np.sum(c * (i + 1))
        c = c + 0.01 * ys[i]
    np.testing.assert_allclose(np.asarray(out), c + ys[0] - ys[1], rtol=1e-5)


def test_switch_without_collectives_is_a_plain_switch():
    mesh = make_mesh(8)
    out = _device_switch([lambda x: x + 1, lambda x: x * 10], jnp.arange(8.0), mesh)
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2, 3, 4, 5, 6, 7, 8])


def test_collectives_that_do_not_pair_are_refused():
    mesh = make_mesh(8)
    branches = [lambda x: jax.lax.psum(x, "data"), lambda x: x]
    with pytest.raises(ValueError, match="different collectives"):
        _device_switch(branches, jnp.arange(8.0), mesh)
