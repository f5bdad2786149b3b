"""The README's first command runs end to end (tiny configuration, fresh process)."""

import re
import subprocess
import sys


def test_demo_trains_and_reports_one_nth_of_the_state():
    n = 4
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeroshard.demo",
            "--devices",
            str(n),
            "--steps",
            "30",
            "--hidden",
            "64",
            "--log-every",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 2
    assert "| fp32 master |" in out and "| Adam moments |" in out
    ratio = float(re.search(r"optimizer state \+ master per device: (\d\.\d+)", out)[1])
    assert abs(ratio - 1 / n) < 0.002  # padding (< N per leaf) and a few scalars
    assert re.search(r"reduce-scatter x1", out) and re.search(r"all-gather x1", out)
