"""The README's Python examples run as written, in order, on the 8 simulated devices."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)  # the checkpoint example writes to a relative path
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert float(namespace["metrics"]["loss"]) > 0
    assert namespace["ckpt"].all_steps() == [int(namespace["state"].step)] == [1]
