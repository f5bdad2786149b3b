"""Executes notebooks/*.ipynb into docs/notebooks/ (git-ignored), for the site.

The notebooks are committed without outputs; ``make docs`` runs this first, and the
site renders the executed copies (Sphinx itself never runs code):

    .venv/bin/python docs/execute_notebooks.py [NAME ...]

Each notebook runs in its own kernel on 8 simulated CPU devices, in a temporary
directory, with this checkout's ``zeroshard`` first on the path. An error in a
notebook fails the build.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "notebooks"
EXECUTED = ROOT / "docs" / "notebooks"


def execute(path: pathlib.Path) -> pathlib.Path:
    """Runs one notebook; writes its executed copy to docs/notebooks/ and returns it."""
    book = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as cwd:
        client = NotebookClient(
            book,
            timeout=900,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": cwd}},
        )
        client.execute()
    out = EXECUTED / path.name
    nbformat.write(book, out)
    return out


def main(names: list[str]) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    EXECUTED.mkdir(exist_ok=True)
    paths = sorted(SOURCE.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if p.stem in names or p.name in names]
    for path in paths:
        start = time.perf_counter()
        out = execute(path)
        print(f"{path.name}: {time.perf_counter() - start:.0f} s -> {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
