"""No import circles inside `atom`, `atom_vllm` or `atom_sglang`.

A circle at load time (module a imports b while b, directly or through others, imports a)
makes the import order matter and breaks with a half-initialised module. The graph here
is built from the sources with `ast`: an edge a -> b for every import that runs when a
is loaded (module body, class bodies, `if`/`try`/`with` blocks), not for imports inside
functions (they run later, once every module is loaded) or under `if TYPE_CHECKING:`.
`from p import x` points at the module p.x where x is a submodule, else at p.

An import inside a function is there to load an optional heavy dependency late (the server
extra, matplotlib, Triton), never to dodge a circle: counted as edges too, with the
`importlib.import_module("x")` calls, they close no circle in `atom` either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import atom

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = {
    "atom": Path(atom.__file__).parent,
    "atom_vllm": ROOT / "packages" / "atom-vllm" / "src" / "atom_vllm",
    "atom_sglang": ROOT / "packages" / "atom-sglang" / "src" / "atom_sglang",
}

# module name -> (source, is a package's __init__)
Sources = dict[str, tuple[str, bool]]


def package_sources(package_dir: Path) -> Sources:
    sources = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        sources[name] = (path.read_text(), is_package)
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def load_time_imports(body: list[ast.stmt]):
    """The import statements of `body` that run when the module is loaded."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from load_time_imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or []:
                    yield from load_time_imports(
                        child.body
                        if isinstance(child, ast.excepthandler | ast.match_case)
                        else [child]
                    )


def _constant_import_call(node: ast.AST) -> str | None:
    """x of `importlib.import_module("x")` / `__import__("x")` (absolute names only)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = getattr(node.func, "attr", getattr(node.func, "id", ""))
    name = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
    if func in ("import_module", "__import__") and isinstance(name, str):
        return None if name.startswith(".") else name
    return None


def every_import(nodes: Iterable[ast.AST]):
    """The imports under `nodes` that may ever run: at load time, inside functions, and
    `import_module("x")` calls (as `import x`); not those under `if TYPE_CHECKING:`."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from every_import(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif name := _constant_import_call(node):
            yield ast.Import(names=[ast.alias(name=name)])
        yield from every_import(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(sources: Sources, imports=load_time_imports) -> dict[str, set[str]]:
    """module -> the modules of the same set it imports at load time (or as `imports`
    finds them in the module's body)."""

    def known(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for node in imports(ast.parse(source).body):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            else:
                base = _absolute(module, is_package, node)
                targets.update(known(f"{base}.{alias.name}") for alias in node.names)
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle `[a, b, ..., a]` per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            if group:
                groups.append({v, *group})

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the group's first module, for the failure message."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected group without a circle")


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(package):
    if not PACKAGES[package].is_dir():
        pytest.skip(f"{package}'s sources are not in this checkout")
    graph = import_graph(package_sources(PACKAGES[package]))
    assert len(graph) > 1
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_deferred_import_closes_a_circle():
    graph = import_graph(package_sources(PACKAGES["atom"]), every_import)
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _cycles(modules: dict[str, str], imports=load_time_imports) -> list[list[str]]:
    """Circles among modules given by name and source; a name that others lie under is a
    package (its source is the __init__)."""
    sources = {
        name: (source, any(other.startswith(f"{name}.") for other in modules))
        for name, source in modules.items()
    }
    return import_cycles(import_graph(sources, imports))


def _pair(a: str, b: str = "import p.a", imports=load_time_imports) -> list[list[str]]:
    return _cycles({"p": "", "p.a": a, "p.b": b}, imports)


def test_finds_circles_of_every_import_form():
    assert _pair("import p.b") == [["p.a", "p.b", "p.a"]]
    assert _pair("import p.b as b")
    assert _pair("from p.b import f", "from p.a import g")
    assert _pair("from p import b", "from p import a")
    assert _pair("from . import b", "from .a import g")
    assert _cycles({"p": "", "p.q": "", "p.a": "from .q.c import f", "p.q.c": "from ..a import g"})
    # a package whose __init__ imports a module that imports the package
    assert _cycles({"p": "from p.a import f", "p.a": "from p import g"})
    assert _cycles({"p": "", "p.a": "import p.b", "p.b": "import p.c", "p.c": "import p.a"}) == [
        ["p.a", "p.b", "p.c", "p.a"]
    ]


def test_finds_circles_through_load_time_blocks():
    for block in (
        "try:\n    import p.b\nexcept ImportError:\n    pass",
        "try:\n    pass\nexcept ImportError:\n    import p.b",
        "import sys\nif sys.platform:\n    pass\nelse:\n    import p.b",
        "class C:\n    import p.b",
        "with open('x'):\n    import p.b",
        "match 1:\n    case 1:\n        import p.b",
    ):
        assert _pair(block), block


def test_ignores_imports_that_do_not_run_at_load_time():
    for block in (
        "def f():\n    import p.b",
        "async def f():\n    import p.b",
        "class C:\n    def f(self):\n        import p.b",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.b",
        "import typing\nif typing.TYPE_CHECKING:\n    from p import b",
    ):
        assert not _pair(block), block
    # modules outside the set (the standard library, torch, other packages) are no edges
    assert not _cycles({"p": "", "p.a": "import os\nimport torch\nimport q.a\nimport p"})


def test_counting_deferred_imports_finds_the_circles_they_dodge():
    for block in (
        "def f():\n    import p.b",
        "class C:\n    def f(self):\n        from p import b",
        "def f():\n    if True:\n        from .b import g",
        "import importlib\ndef f():\n    importlib.import_module('p.b')",
        "def f():\n    __import__('p.b')",
    ):
        assert _pair(block, imports=every_import), block
    for block in (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.b",
        "def f():\n    import torch\n    import importlib\n    importlib.import_module(name)",
    ):
        assert not _pair(block, imports=every_import), block
