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
how to resume (a CRITICAL record of the ``zeroshard.training.peers`` logger: on stderr unless
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
        self._watched = 0

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
        limit = self.first_timeout_s if self._watched == 0 else self.timeout_s
        timer = threading.Timer(limit, self._fail, [f"{what} did not finish in {limit:.0f} s"])
        timer.daemon = True
        timer.start()
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            first_line = str(e).strip().splitlines()[0][:300]
            self._fail(f"{what} failed: {type(e).__name__}: {first_line}")
        finally:
            timer.cancel()
            self._watched += 1

    def _fail(self, reason: str) -> None:
        where = _restart_point(self.checkpoint_dir)
        logger.critical(
            f"zeroshard: process {jax.process_index()} of {jax.process_count()} stops: a peer "
            f"process was lost. {reason}. Another process died or hangs, and the run cannot "
            f"continue without it. To resume, {self.resume}: it restarts {where}, on any "
            f"number of devices. Exiting with code {EXIT_CODE}."
        )
        logging.shutdown()  # flushes every handler: os._exit skips the flush at exit
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _restart_point(directory: str | None) -> str:
    """Where a resumed run restarts: the newest finalised step in ``directory`` (orbax
    names them by number)."""
    if directory is None:
        return "no checkpoint directory was given"
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = [int(name) for name in names if re.fullmatch(r"\d+", name)]
    if not steps:
        return f"no finalised step in {directory}"
    return f"from step {max(steps)} in {directory}"
