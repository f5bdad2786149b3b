"""Start ``examples/multihost.py`` (or another script's) processes, signal them, and
bound them in time."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "multihost.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(processes: int) -> dict:
    """The environment of each of ``processes`` processes of one run."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if processes > 1:
        # On jax 0.12.1 a multi-process run whose step comes from the persistent
        # compilation cache (tests/conftest.py) hangs in step 1: they compile.
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


class Run:
    """``processes`` processes of the example, or of ``script`` (8 devices in all), logs
    in ``tmp_path``. The script takes the example's ``--local-devices``,
    ``--num-processes``, ``--process-id`` and ``--coordinator``.

    Every process is started in its own session and killed, with its children, by
    :meth:`finish` if it outlives the run's deadline.
    """

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        processes: int,
        *args: str,
        timeout: float = 120,
        script: str = EXAMPLE,
    ):
        self.logs = [tmp_path / f"{name}.{i}.log" for i in range(processes)]
        self.deadline = time.monotonic() + timeout
        common = ["--local-devices", str(8 // processes), *args]
        if processes > 1:
            common += ["--coordinator", f"127.0.0.1:{free_port()}"]
        env = process_env(processes)
        self.procs = []
        for i, log in enumerate(self.logs):
            extra = ["--num-processes", str(processes), "--process-id", str(i)]
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-u", script, *common, *extra],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )

    def text(self, i: int) -> str:
        return "\n".join(
            line for line in self.logs[i].read_text().splitlines() if "[Gloo]" not in line
        )

    def wait_for(self, pattern: str, i: int = 0) -> None:
        """Waits until process ``i`` has printed a line matching ``pattern``."""
        while time.monotonic() < self.deadline:
            if re.search(pattern, self.text(i), re.MULTILINE):
                return
            if self.procs[i].poll() is not None:
                break
            time.sleep(0.05)
        self.finish()
        raise AssertionError(f"process {i} never printed {pattern!r}:\n{self.text(i)[-3000:]}")

    def signal(self, i: int, sig: int) -> float:
        """Sends ``sig`` to process ``i``; returns when (``time.monotonic()``)."""
        self.procs[i].send_signal(sig)
        return time.monotonic()

    def finish(self) -> list[int | None]:
        """Waits for every process until the deadline, then kills what is left.
        Returns the exit codes (``None``: it hung and was killed)."""
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(self.deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                codes.append(None)
        return codes

    def report(self) -> str:
        return "\n".join(f"--- process {i}:\n{self.text(i)[-2000:]}" for i in range(len(self.logs)))
