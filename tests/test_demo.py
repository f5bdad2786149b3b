"""The README's first command runs end to end (tiny configuration, fresh process)."""

import re
import signal
import subprocess
import sys


def test_demo_trains_resumes_and_reports_one_nth_of_the_state(tmp_path):
    n, plot = 4, tmp_path / "demo.png"
    args = [
        "--devices",
        n,
        "--steps",
        24,
        "--batch",
        8,
        "--context",
        16,
        "--d-model",
        32,
        "--layers",
        1,
        "--heads",
        2,
        "--lr",
        1e-2,
        "--plot",
        plot,
        "--checkpoint-dir",
        tmp_path / "ckpt",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard.demo", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.split("Resumed")[0])]
    assert len(losses) >= 5 and losses[-1] < losses[0]
    # The resumed run (on 2 devices) continues the curve of the uninterrupted one.
    gap = float(re.search(r"largest gap over 12 steps: ([\d.e+-]+)", out)[1])
    assert "Resumed step 12 on 2 devices" in out and gap < 1e-2
    for row in ("AdamW moments (fp32)", "master weights (fp32)"):
        cells = re.search(rf"\| {re.escape(row)} \| ([\d,]+) \| ([\d,]+) \|", out).groups()
        replicated, ours = (int(c.replace(",", "")) for c in cells)
        assert abs(ours / replicated - 1 / n) < 0.01
    ratio = float(re.search(r"Optimizer state \+ master per device: (\d\.\d+)", out)[1])
    assert abs(ratio - 1 / n) < 0.005  # padding (< N per leaf) and a few scalars
    assert plot.stat().st_size > 10_000


def preempted(args):
    """Runs the demo and sends SIGTERM after its first progress line; returns stdout."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"\]\s+\d+/100", line):  # a progress line: training is under way
                proc.send_signal(signal.SIGTERM)
                break
        out = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    return out


def test_demo_stops_on_sigterm_and_the_same_command_resumes(tmp_path):
    """SIGTERM during training: exit 0 with the step saved. The same command again
    resumes from that step (and is stopped the same way, to keep the test short)."""
    args = [sys.executable, "-u", "-m", "zeroshard.demo", "--devices", "2", "--steps", "100"]
    args += ["--batch", "4", "--context", "8", "--d-model", "16", "--layers", "1"]
    args += ["--heads", "2", "--plot", "", "--checkpoint-dir", str(tmp_path / "ckpt")]
    out = preempted(args)
    stop = int(re.search(r"Preempted: saved step (\d+)", out)[1])
    assert stop < 100 and "Sample" not in out
    again = preempted(args)
    assert f"Resuming from step {stop} in {tmp_path / 'ckpt'}" in again
    later = int(re.search(r"Preempted: saved step (\d+)", again)[1])
    assert stop < later < 100
