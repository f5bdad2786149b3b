"""SIGTERM in the middle of a run: the step in flight finishes, every process stops at
the same step, saves it and exits 0; the same command resumes bit-identically.

The runs are ``examples/multihost.py`` in fresh processes (``multihost_runs.Run``),
each bounded in time.
"""

import logging
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from multihost_runs import Run, free_port

import zeroshard as zs

STEPS = 12


def out_arrays(path):
    with np.load(path) as f:
        return dict(f)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process x 8 devices, all STEPS steps in one go."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run = Run(tmp, "ref", 1, "--steps", str(STEPS), "--out", str(tmp / "ref.npz"))
    assert run.finish() == [0], run.report()
    return out_arrays(tmp / "ref.npz")


def stop_steps(run, processes):
    found = [re.findall(r"process \d: preempted, saved step (\d+)", run.text(i)) for i in processes]
    assert all(len(f) == 1 for f in found), run.report()
    return [int(f[0]) for f in found]


def test_sigterm_saves_the_step_in_flight_and_the_rerun_is_bit_identical(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    args = ["--steps", str(STEPS), "--ckpt", str(ckpt), "--out", str(tmp_path / "out.npz")]
    run = Run(tmp_path, "first", 1, *args, "--step-seconds", "0.3")
    run.wait_for(r"^step 3:")
    run.signal(0, signal.SIGTERM)
    assert run.finish() == [0], run.report()
    (stop,) = stop_steps(run, [0])
    assert 3 <= stop < STEPS
    assert zs.CheckpointManager(ckpt).all_steps() == [stop]  # finalised
    assert not (tmp_path / "out.npz").exists()  # it stopped, it did not finish
    # The same command again: resumes from the saved step and finishes.
    rerun = Run(tmp_path, "rerun", 1, *args, "--step-seconds", "0.3")
    assert rerun.finish() == [0], rerun.report()
    resumed = out_arrays(tmp_path / "out.npz")
    assert set(resumed) == set(uninterrupted)
    np.testing.assert_array_equal(resumed["losses"], uninterrupted["losses"][stop:])
    for key in uninterrupted:
        if key != "losses":
            np.testing.assert_array_equal(resumed[key], uninterrupted[key], err_msg=key)


def test_two_processes_stop_at_the_same_step_when_one_gets_sigterm(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    args = ["--steps", str(STEPS), "--ckpt", str(ckpt), "--timeout", "30"]
    run = Run(tmp_path, "two", 2, *args, "--step-seconds", "0.3")
    run.wait_for(r"^step 3:")
    run.signal(1, signal.SIGTERM)  # a scheduler takes one host
    assert run.finish() == [0, 0], run.report()
    stop0, stop1 = stop_steps(run, [0, 1])
    assert stop0 == stop1 and 3 <= stop0 < STEPS, run.report()
    assert zs.CheckpointManager(ckpt).all_steps() == [stop0]
    # Resumed by the same command, it ends where the uninterrupted run does (up to
    # the summation order of 2 x 4 devices against 1 x 8).
    rerun = Run(tmp_path, "rerun", 2, *args, "--out", str(tmp_path / "out.npz"))
    assert rerun.finish() == [0, 0], rerun.report()
    resumed = out_arrays(tmp_path / "out.npz")
    np.testing.assert_allclose(resumed["losses"], uninterrupted["losses"][stop0:], rtol=1e-6)
    for key in uninterrupted:
        if key != "losses":
            scale = max(np.max(np.abs(uninterrupted[key])), 1e-30)
            np.testing.assert_allclose(resumed[key], uninterrupted[key], atol=1e-6 * scale)


def test_the_guard_in_one_process_stops_after_the_step_in_flight(caplog):
    previous = signal.getsignal(signal.SIGTERM)
    with zs.PreemptionGuard() as guard, caplog.at_level(logging.INFO, logger="zeroshard"):
        assert not guard.distributed and not guard.should_stop(1)
        assert not caplog.records
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
        assert guard.requested and guard.should_stop(2) and guard.stop_step == 2
        assert guard.should_stop(2) and not guard.should_stop(3)  # one stop step
    (record,) = caplog.records  # logged once, when the stop step is decided
    assert (record.name, record.levelno) == ("zeroshard.training.preemption", logging.WARNING)
    assert record.getMessage() == "zeroshard: preemption signalled; stopping at step 2"
    assert signal.getsignal(signal.SIGTERM) is previous  # handler put back


UNDER_DISTRIBUTED = """
import sys
import jax
jax.config.update("jax_enable_preemption_service", sys.argv[2] == "on")
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
import zeroshard as zs
try:
    guard = zs.PreemptionGuard()
    print("distributed", guard.distributed, "stop", guard.should_stop(1))
except ValueError as e:
    print("ValueError", e)
jax.distributed.shutdown()
"""


@pytest.mark.parametrize("service", ["on", "off"])
def test_the_guard_under_jax_distributed_needs_its_preemption_service(service):
    """In a process where ``jax.distributed`` is initialised, the guard agrees through
    jax's preemption service, or refuses to start without it."""
    command = [sys.executable, "-c", UNDER_DISTRIBUTED, str(free_port()), service]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    if service == "on":
        assert "distributed True stop False" in run.stdout, run.stdout + run.stderr
    else:
        assert "ValueError jax.distributed is initialised without its preemption" in run.stdout
