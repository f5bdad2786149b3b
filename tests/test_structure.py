"""The shape of the package: no function over 60 code lines, no class over 200, no
module-private name (a leading underscore) imported by another module, and no import cycle
between its modules.

Code lines leave out blank lines, comments and docstrings. Run it alone to see the
counts: ``python tests/test_structure.py [PACKAGE_DIR]`` prints every module's code lines and the
longest functions.
"""

from __future__ import annotations

import ast
import functools
import io
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "zeroshard"
MAX_FUNCTION, MAX_CLASS = 60, 200


def code_lines(source: str) -> set[int]:
    """The numbers of the lines that hold code (not blank, comment or docstring)."""
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            value = getattr(first, "value", None)
            if isinstance(first, ast.Expr) and isinstance(getattr(value, "value", None), str):
                lines -= set(range(first.lineno, first.end_lineno + 1))
    return lines


def measure(package: Path = PACKAGE) -> tuple[dict, list, list, list]:
    """Code lines per module; every function's and class's code lines; private imports."""
    modules, functions, classes, private = {}, [], [], []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        lines = code_lines(source)
        name = str(path.relative_to(package))
        modules[name] = len(lines)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                span = len([k for k in lines if node.lineno <= k <= node.end_lineno])
                kind = classes if isinstance(node, ast.ClassDef) else functions
                kind.append((f"{name}:{node.name}", span))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zeroshard"):
                private += [
                    f"{name} <- {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return modules, functions, classes, private


def test_no_long_function_or_class_and_no_private_import():
    _, functions, classes, private = measure()
    long_functions = [f for f in functions if f[1] > MAX_FUNCTION]
    long_classes = [c for c in classes if c[1] > MAX_CLASS]
    assert (long_functions, long_classes, private) == ([], [], [])


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Per module, the package's modules its module-level imports name (those under
    ``if TYPE_CHECKING:`` and in ``try`` blocks too; imports inside functions run late
    and are left out, as is the package's ``__init__``, which imports everything)."""
    names = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts): p
        for p in package.rglob("*.py")
        if p.name != "__init__.py"
    }

    def imported(statements: list) -> set[str]:
        out: set[str] = set()
        for st in statements:
            if isinstance(st, ast.Import):
                out.update(a.name for a in st.names)
            elif isinstance(st, ast.ImportFrom) and st.module:
                out.update({st.module} | {f"{st.module}.{a.name}" for a in st.names})
            elif isinstance(st, ast.If | ast.Try):
                out |= imported(st.body + st.orelse)
        return out

    return {
        name: imported(ast.parse(path.read_text()).body) & set(names) - {name}
        for name, path in names.items()
    }


def cycle_from(graph: dict[str, set[str]], start: str, path: tuple = (), done=None) -> tuple:
    """A cycle of imports reachable from ``start`` (the modules in order), or ``()``;
    ``done`` collects the modules from which none is reachable."""
    done = set() if done is None else done
    if start in path:
        return (*path[path.index(start) :], start)
    for nxt in sorted(graph[start] - done):
        found = cycle_from(graph, nxt, (*path, start), done)
        if found:
            return found
    done.add(start)
    return ()


def test_no_import_cycle():
    graph = import_graph()
    assert [c for c in map(functools.partial(cycle_from, graph), graph) if c] == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_from(graph, "d") == ("a", "b", "c", "a")


if __name__ == "__main__":
    modules, functions, classes, private = measure(Path(sys.argv[1]) if sys.argv[1:] else PACKAGE)
    for name, n in modules.items():
        print(f"{n:6d}  {name}")
    print(f"{sum(modules.values()):6d}  code lines in {len(modules)} modules")
    top = sorted(functions, key=lambda f: -f[1])[:5]
    print("longest functions:", ", ".join(f"{name} {n}" for name, n in top))
    print("longest class:", max(classes, key=lambda c: c[1]))
    print("private names imported across modules:", private or "none")
    sys.exit(0)
