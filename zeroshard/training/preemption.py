"""Preemption: stop a training loop cleanly on SIGTERM, at one step on every process.

Schedulers (TPU, Slurm, Kubernetes) send SIGTERM some time before they take a host.
:class:`PreemptionGuard` turns that signal into a decision the loop reads after each
step: the step in flight finishes, every process agrees on the step to stop at, the
loop saves that step, waits for the save to be committed and exits 0. Started again
with the same command, the loop resumes from the latest step.

- One process: a Python signal handler sets a flag; the loop stops after the step
  in flight.
- Several processes (``jax.distributed``): jax's preemption sync manager (started by
  ``jax.distributed.initialize``) catches SIGTERM on whichever process receives it,
  tells the others through the coordination service, and
  ``multihost_utils.reached_preemption_sync_point`` (what orbax's
  ``CheckpointManager.reached_preemption`` calls) returns ``True`` on every process
  at the same step: one past the largest step any process had reached. No Python
  handler is installed then: it would replace jax's.

Example:
    >>> import zeroshard as zs
    >>> with zs.PreemptionGuard() as guard:
    ...     for step in range(1, 4):
    ...         pass  # state, metrics = train_step(state, batch)
    ...         if guard.should_stop(step):
    ...             break  # ckpt.save(state); ckpt.close(); sys.exit(0)
    >>> guard.stop_step is None  # no SIGTERM arrived
    True
"""

from __future__ import annotations

import logging
import signal
import threading

import jax

logger = logging.getLogger(__name__)


class PreemptionGuard:
    """Tells a training loop, after each step, whether to save and stop.

    Create it before the loop (it installs its signal handler then) and call
    :meth:`should_stop` with the step just finished, on every process, after every
    step. It returns ``True`` once, at the same step on every process; save that
    step, wait for the save (``ckpt.close()``) and exit 0.

    Args:
      signals: the signals that mean "preempted" in one process (default SIGTERM).
        Under ``jax.distributed`` jax's preemption service listens for SIGTERM
        itself and this argument is unused.

    Raises:
      ValueError: under ``jax.distributed`` with jax's preemption service disabled.

    Example:
      A preemption-safe loop with automatic resume (``examples/multihost.py`` and
      ``python -m zeroshard.demo`` are complete ones)::

        ckpt = zs.CheckpointManager(directory, tx)
        state = (ckpt.restore(mesh, like=params) if ckpt.latest_step() is not None
                 else zs.init_train_state(params, tx, mesh))
        guard = zs.PreemptionGuard()
        while int(state.step) < num_steps:
            state, metrics = train_step(state, next_batch(int(state.step)))
            if guard.should_stop(int(state.step)):
                ckpt.save(state)
                ckpt.close()  # waits until the step is committed on disk
                sys.exit(0)
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        self.stop_step: int | None = None
        """The step :meth:`should_stop` returned ``True`` for, else ``None``."""
        self.distributed = jax.distributed.is_initialized()
        """Whether processes agree through jax's preemption sync manager."""
        if self.distributed and not jax.config.jax_enable_preemption_service:
            # jax.distributed.initialize starts the service only when the option is on
            raise ValueError(
                "jax.distributed is initialised without its preemption service, which "
                "PreemptionGuard needs to agree on a stop step across processes: set "
                "jax.config.update('jax_enable_preemption_service', True) before "
                "jax.distributed.initialize()."
            )
        if not self.distributed:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, lambda signum, frame: self._event.set())

    @property
    def requested(self) -> bool:
        """Whether this process received the signal (single process only)."""
        return self._event.is_set()

    def should_stop(self, step: int) -> bool:
        """Whether to save ``step`` and stop: ``True`` at the same step on every process.

        Args:
          step: the step just finished (``int(state.step)``); it must grow by one per
            call, from the same value on every process.

        Returns:
          ``True`` once preemption was signalled and this is the step every process
          stops at (logged then as a warning of the ``zeroshard.training.preemption`` logger);
          ``False`` otherwise.
        """
        if self.stop_step is not None:
            return step == self.stop_step
        if self.distributed:
            from jax.experimental import multihost_utils

            stop = multihost_utils.reached_preemption_sync_point(step)
        else:
            stop = self._event.is_set()
        if stop:
            self.stop_step = step
            logger.warning("zeroshard: preemption signalled; stopping at step %d", step)
        return stop

    def close(self) -> None:
        """Puts back the signal handlers that were installed before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
