"""The wheel people install: its license, its type marker, its metadata, one version.

The wheel is built offline from a copy of the sources (``pip wheel --no-deps
--no-build-isolation``, with the environment's own setuptools, which the ``test`` extra
installs), so the test needs no network and leaves no ``build/`` in the checkout.
"""

import email.parser
import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

import zeroshard as zs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DIST_INFO = f"zeroshard-{PROJECT['version']}.dist-info"


def test_the_version_is_the_installed_distribution_s():
    assert zs.__version__ == importlib.metadata.version("zeroshard")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of the files a wheel is made of."""
    pytest.importorskip("setuptools", minversion="77.0.3")  # PEP 639; pip install -e '.[test]'
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "zeroshard", src / "zeroshard", ignore=ignore)
    command = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps"]
    command += ["--no-build-isolation", "--no-index", "--quiet", "-w", str(out)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("zeroshard-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def test_the_wheel_holds_the_package_its_data_and_the_type_marker(wheel):
    names = set(wheel.namelist())
    assert {"zeroshard/__init__.py", "zeroshard/py.typed", "zeroshard/data/corpus.txt"} <= names
    assert "zeroshard/checkpointing/__init__.py" in names
    # Nothing from beside the package: no tests, examples, notebooks or benchmarks.
    assert all(n.startswith(("zeroshard/", f"{DIST_INFO}/")) for n in names), sorted(names)


def test_the_wheel_holds_the_license(wheel):
    text = wheel.read(f"{DIST_INFO}/licenses/LICENSE").decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "Copyright 2026 The zeroshard authors" in text


def test_the_wheel_metadata_names_license_classifiers_and_floors(wheel):
    meta = email.parser.Parser().parsestr(wheel.read(f"{DIST_INFO}/METADATA").decode())
    assert meta["Name"] == "zeroshard" and meta["Version"] == PROJECT["version"]
    assert tuple(map(int, meta["Metadata-Version"].split("."))) >= (2, 4)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier")
    assert classifiers == PROJECT["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the expression
    assert meta["Requires-Python"] == ">=3.11"
    requires = meta.get_all("Requires-Dist")
    floors = {r.name: r.specifier for r in map(Requirement, requires) if r.marker is None}
    for name, floor in (("jax", "0.10.2"), ("optax", "0.2.8"), ("numpy", "2.4.6")):
        assert f">={floor}" in {str(s) for s in floors[name]}, requires
