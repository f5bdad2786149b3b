"""Sphinx configuration of zeroshard's documentation site (``make docs``).

Sphinx with myst-nb, as jax, optax, flax and orbax build theirs: Markdown pages, the
API reference from the docstrings (autodoc + napoleon for the Google-style sections),
and the notebooks rendered from the copies ``make docs`` executes first (never run
by Sphinx itself).
"""

import importlib
import os
import sys

# Document this checkout's package, whatever the virtual environment has installed.
sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import zeroshard

project = "zeroshard"
author = "the zeroshard authors"
copyright = "the zeroshard authors"
release = version = zeroshard.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["README.md", "execute_notebooks.py", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}

# Markdown: GitHub-style anchors for the in-page links, ```{directive} fences.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks: render the executed copies make docs writes to docs/notebooks/;
# never execute them while building.
nb_execution_mode = "off"
nb_merge_streams = True

# API reference: Google-style docstrings; signatures keep their type hints.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list: no second entry per field
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "undoc-members": False}

# Cross-references inside zeroshard must resolve (nitpicky); names from other
# libraries have no inventory offline (no intersphinx), so they are not checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|flax|nnx|orbax|ocp|numpy|np|jnp|chex)(\..*)?"),
    (r"py:.*", r"(typing|collections|dataclasses|enum|os|pathlib|logging|signal)(\..*)?"),
    (r"py:.*", r"(etils|ArrayTree)(\..*)?"),
    (r"py:class", r"PyTree"),  # zeroshard.core.layout.PyTree: an alias of Any
]

html_theme = "sphinx_book_theme"
html_title = f"zeroshard {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}


def _find(path: str):
    """The object at dotted ``path`` (a module, then attributes), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "_fields", ())
            if name in fields:  # a field without a class attribute
                return fields
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


def _internal_reference(app, env, node, contnode):
    """Docstrings name internal modules, classes and functions (``:func:`arrive```,
    ``:class:`zeroshard.core.placement.Storage```) that the reference does not document.
    Such a reference is kept as plain text when it names a real zeroshard object,
    looked up the way Python's domain would (absolute, then from the current module
    and class); any other unresolved reference stays a warning, so a typo or a
    renamed object fails the strict build."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates.append(f"{module}.{target}")
        if cls:
            candidates.append(f"{module}.{cls}.{target}")
            # A re-exported class (zeroshard.PeerWatchdog): its own module's names.
            home = getattr(_find(f"{module}.{cls}"), "__module__", None)
            if home:
                candidates += [f"{home}.{target}", f"{home}.{cls}.{target}"]
    for path in candidates:
        if path.startswith("zeroshard") and _find(path) is not None:
            return contnode
    return None


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are documented by the class's "Attributes:" section."""
    if type(obj).__name__ == "_tuplegetter":
        return True
    return None


def setup(app):
    app.connect("missing-reference", _internal_reference)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
