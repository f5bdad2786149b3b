"""The README's first command runs end to end (tiny configuration, fresh process)."""

import re
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
