"""A peer lost mid-run: the survivor exits non-zero with a message that says how to
resume, within the documented time (``--step-timeout``, half of ``--timeout``)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from multihost_runs import Run

import zeroshard as zs
from zeroshard.training.peers import EXIT_CODE


def lost_peer(tmp_path, sig, timeout):
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "200", "--ckpt", str(ckpt), "--save-at", "3", "--timeout", str(timeout)]
    run = Run(tmp_path, "run", 2, *args, "--step-seconds", "0.2", timeout=150)
    run.wait_for(r"^step 5:")
    sent = run.signal(1, sig)
    code = run.procs[0].wait(timeout=max(run.deadline - time.monotonic(), 1))
    took = time.monotonic() - sent
    run.procs[1].kill()
    run.finish()
    message = run.text(0)
    assert code == EXIT_CODE, run.report()
    assert "process 0 of 2 stops: a peer process was lost" in message
    assert f"restarts from step 3 in {ckpt}, on any number of devices" in message
    return took, message


def test_sigkill_of_one_process_ends_the_other_at_once_with_a_message(tmp_path):
    """gloo's collective fails as soon as the peer's sockets close."""
    took, message = lost_peer(tmp_path, signal.SIGKILL, timeout=30)
    assert re.search(r"step \d+ failed: JaxRuntimeError", message)
    assert took < 15, f"the survivor took {took:.1f} s"


def test_a_peer_that_hangs_ends_the_other_after_the_step_timeout(tmp_path):
    """SIGSTOP: the peer's sockets stay open and the collective waits; the watchdog
    ends the survivor after --step-timeout (5 s here), before jax's heartbeat abort."""
    took, message = lost_peer(tmp_path, signal.SIGSTOP, timeout=10)
    assert re.search(r"step \d+ did not finish in 5 s", message)
    assert 4 < took < 9, f"the survivor took {took:.1f} s"


def test_the_watchdog_does_nothing_in_one_process():
    watchdog = zs.PeerWatchdog(0.01)
    assert not watchdog.active
    with watchdog.watch("step 1"):
        time.sleep(0.1)  # over the limit, but there is no peer to lose
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        zs.PeerWatchdog(0)


WATCHDOG_FAILS = """
import logging, sys
import jax
import zeroshard as zs
if sys.argv[1] == "configured":
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s", stream=sys.stdout)
watchdog = zs.PeerWatchdog(5, checkpoint_dir=sys.argv[2])
watchdog.active = True  # as in a multi-process run
with watchdog.watch("step 7"):
    raise jax.errors.JaxRuntimeError("Connection reset by peer")
"""


@pytest.mark.parametrize("logging_setup", ["default", "configured"])
def test_the_watchdog_s_message_is_a_critical_log_record(logging_setup, tmp_path):
    """The message goes through the ``zeroshard.training.peers`` logger: to stderr when the
    program configured no logging, else to its handlers (flushed before the exit)."""
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG_FAILS, logging_setup, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == EXIT_CODE, proc.stderr
    out = proc.stderr if logging_setup == "default" else proc.stdout
    message = "zeroshard: process 0 of 1 stops: a peer process was lost. step 7 failed: "
    assert message + "JaxRuntimeError: Connection reset by peer" in out, (proc.stdout, proc.stderr)
    assert f"no finalised step in {tmp_path}" in out
    if logging_setup == "configured":
        assert out.startswith("zeroshard.training.peers CRITICAL zeroshard: process 0 of 1 stops")
