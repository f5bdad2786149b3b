"""Lost peers: end the surviving processes of a multi-process run quickly and clearly.

When one process of a ``jax.distributed`` run dies (killed, out of memory, its host
taken), the others cannot continue: every step is a collective that needs it. What
they do by default is not actionable: a collective raises (gloo on CPU: "Connection
reset by peer") and Python starts to exit, jax's shutdown barrier then waits for the
dead peer until the heartbeat timeout, and the process aborts with a C++ stack trace
(exit code 134); a collective that hangs instead (other backends) waits for the
heartbeat timeout too.

:class:`PeerWatchdog` watches each step (or save) of the loop. If the step raises a
runtime error, or does not finish within ``timeout_s``, it logs what happened and
how to resume (a CRITICAL record of the ``zeroshard.peers`` logger: on stderr unless
logging is configured otherwise), and ends the process at once with exit code
:data:`EXIT_CODE`
(``os._exit``: the shutdown barrier is skipped, it could only wait for the dead
peer). The survivors therefore exit within about ``timeout_s`` of the peer's death
(at once where the collective fails, as gloo's does), before jax's own abort at the
heartbeat timeout: keep ``timeout_s`` below ``heartbeat_timeout_seconds`` of
``jax.distributed.initialize``, and well above a normal step.

Python cannot catch jax's C++ abort itself; the watchdog acts before it. It cannot
act first when the lost process is the one hosting jax's coordination service
(process 0): the others' clients then abort within a fraction of a second with jax's
own message. In a single process the watchdog does nothing (there is no peer to
lose).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator

import jax

logger = logging.getLogger(__name__)

EXIT_CODE = 75
"""Exit status of a process ended by :class:`PeerWatchdog` (``EX_TEMPFAIL``: retry)."""


class PeerWatchdog:
    """Ends this process with a clear message when a peer process is lost.

    Args:
      timeout_s: the longest a watched block may take (a step, a save) before the
        run is considered broken. Below jax.distributed's heartbeat timeout.
      first_timeout_s: the limit for the first watched block, which usually
        compiles the step (default: ``4 * timeout_s``).
      checkpoint_dir: where the run saves; the message names its latest step.
      resume: how to resume, for the message (default: run the same command again
        on every process).

    Example:
      Under ``jax.distributed``, around each step (``examples/multihost.py``)::

        watchdog = zs.PeerWatchdog(timeout_s=30, checkpoint_dir=ckpt.directory)
        for i in range(start, num_steps):
            with watchdog.watch(f"step {i + 1}"):
                state, metrics = train_step(state, batch(i))
                loss = float(metrics["loss"])  # waits for the step to finish
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        first_timeout_s: float | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        resume: str = "run the same command again on every process",
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(first_timeout_s or 4 * timeout_s)
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.resume = resume
        self.active = jax.process_count() > 1
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._started = 0.0
        self._watched = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Watches one block (a step, including reading its result; a save).

        In a multi-process run, a ``JaxRuntimeError`` raised in the block, or the
        block outliving its time limit, ends the process with :data:`EXIT_CODE` after
        the message; other exceptions pass through.

        Args:
          what: what the block does, for the message (``"step 12"``).
        """
        if not self.active:
            yield
            return
        self._start_thread()
        limit = self.first_timeout_s if self._watched == 0 else self.timeout_s
        with self._lock:
            self._what, self._started = what, time.monotonic()
            self._deadline = self._started + limit
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            first_line = str(e).strip().splitlines()[0][:300]
            self._fail(f"{what} failed: {type(e).__name__}: {first_line}")
        finally:
            with self._lock:
                self._deadline = None
            self._watched += 1

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="PeerWatchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what, took = self._what, time.monotonic() - self._started
            if late:
                self._fail(f"{what} did not finish in {took:.0f} s")

    def _fail(self, reason: str) -> None:
        latest = _latest_step(self.checkpoint_dir)
        where = (
            "no checkpoint directory was given"
            if self.checkpoint_dir is None
            else f"no finalised step in {self.checkpoint_dir}"
            if latest is None
            else f"from step {latest} in {self.checkpoint_dir}"
        )
        logger.critical(
            "zeroshard: process %d of %d stops: a peer process was lost. %s. Another "
            "process died or hangs, and the run cannot continue without it. To resume, "
            "%s: it restarts %s, on any number of devices. Exiting with code %d.",
            jax.process_index(),
            jax.process_count(),
            reason,
            self.resume,
            where,
            EXIT_CODE,
        )
        _flush_logs()
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _flush_logs() -> None:
    """Flushes the handlers this module's records reach (``os._exit`` skips the flush
    at interpreter exit)."""
    node: logging.Logger | None = logger
    while node is not None:
        for handler in node.handlers:
            handler.flush()
        node = node.parent if node.propagate else None
    if logging.lastResort is not None:
        logging.lastResort.flush()


def _latest_step(directory: str | None) -> int | None:
    """The newest finalised step in ``directory`` (orbax names them by number)."""
    if directory is None or not os.path.isdir(directory):
        return None
    steps = [int(name) for name in os.listdir(directory) if re.fullmatch(r"\d+", name)]
    return max(steps, default=None)
