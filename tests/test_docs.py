"""The documentation site (docs/) documents every public name.

No site is built here (``make docs`` builds it, warnings as errors): these tests read
the autodoc directives of the API reference pages (docs/api/*.rst).
"""

from __future__ import annotations

import pathlib
import re

import optax
import pytest

import zeroshard

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_PAGES = ROOT / "docs" / "api"
DIRECTIVE = re.compile(
    r"^\.\. auto(?:function|class|exception|data)::\s+(zeroshard(?:\.flax)?)\.(\w+)\s*$",
    re.MULTILINE,
)


def documented() -> dict[tuple[str, str], list[str]]:
    """(module, name) -> the reference pages with an autodoc directive for it."""
    found: dict[tuple[str, str], list[str]] = {}
    for page in sorted(API_PAGES.glob("*.rst")):
        for module, name in DIRECTIVE.findall(page.read_text()):
            found.setdefault((module, name), []).append(page.name)
    return found


def public_names(module: str) -> set[str]:
    """``zeroshard.__all__``; for ``zeroshard.flax`` (no ``__all__``), the functions
    and classes it defines without a leading underscore."""
    if module == "zeroshard":
        return set(zeroshard.__all__)
    flax = pytest.importorskip("zeroshard.flax")
    if hasattr(flax, "__all__"):
        return set(flax.__all__)
    return {
        name
        for name, obj in vars(flax).items()
        if not name.startswith("_") and getattr(obj, "__module__", None) == flax.__name__
    }


@pytest.mark.parametrize("module", ["zeroshard", "zeroshard.flax"])
def test_reference_documents_every_public_name(module):
    names = {name for mod, name in documented() if mod == module}
    missing = sorted(public_names(module) - names)
    assert not missing, (
        f"{module} names with no page in docs/api/: {missing}. Add "
        f"'.. autofunction:: {module}.NAME' (or autoclass, autoexception, autodata) "
        "to the page of its topic."
    )


def test_reference_documents_public_names_once():
    for (module, name), pages in documented().items():
        assert name in public_names(module), (
            f"docs/api/{pages[0]} documents {module}.{name}, which is not public"
        )
        assert len(pages) == 1, f"{module}.{name} is documented twice: {pages}"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("Shard", "zs.Piece", lambda: zeroshard.Piece),
        (
            "Sharded",
            "tx.optimizer",
            lambda: zeroshard.sharded(optax.sgd(0.1)).optimizer.__class__,
        ),
        ("collectives", "zs.compiled_collectives", lambda: zeroshard.compiled_collectives),
    ],
)
def test_earlier_names_still_work_and_warn_of_the_new_one(old, new, expected):
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        got = getattr(zeroshard, old)
    assert got is expected()
    assert old not in zeroshard.__all__
