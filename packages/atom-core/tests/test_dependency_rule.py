"""docs/architecture.md, "Three packages, one rule": `atom` never imports a host or a host
plugin, and the plugins use only ATOM's public API: nothing from the native engine
(`atom.engine`).

Every .py under the packages' sources is parsed (not imported), so the rule is checked
without vLLM or SGLang installed. An import is any of `import x`, `from x import y`,
`importlib.import_module("x")`, `__import__("x")` (also with an f-string that starts with
a package: `f"x.{name}"`), and a lazy `"x:Name"` reference (what vLLM's
`ModelRegistry.register_model` and entry points take), also as the head of an f-string
(`f"x:{name}"`). An `import_module` / `__import__` of a name the source does not spell out
would hide a host import from the rule, so `atom` has none outside the allow-list below.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import atom

ROOT = Path(__file__).resolve().parents[3]
PLUGIN_SOURCES = {
    "atom_vllm": ROOT / "packages" / "atom-vllm" / "src" / "atom_vllm",
    "atom_sglang": ROOT / "packages" / "atom-sglang" / "src" / "atom_sglang",
}

HOSTS = ("vllm", "sglang", "atom_vllm", "atom_sglang")  # what atom never imports
ATOM_INTERNAL = ("atom.engine",)  # what the plugins never import

# The files of `atom` (relative to its package directory) that may import a module named
# only at run time, each with why.
RUN_TIME_IMPORTS_ALLOWED = {
    # `atom bench` runs vLLM and SGLang as peer engines, each in a process of its own that
    # the benchmark launches; the job names the host this driver process runs. atom itself
    # never imports a host.
    "bench/driver.py",
}

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_REFERENCE = re.compile(rf"({_DOTTED}):[A-Za-z_][\w.]*")  # "module:Class"
_REFERENCE_HEAD = re.compile(rf"({_DOTTED}):[\w.]*")  # f"module:{name}"


def _constant_str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _is_dynamic_import(node: ast.Call) -> bool:
    """A call of `import_module` or `__import__`, as a bare name or an attribute."""
    func = getattr(node.func, "attr", getattr(node.func, "id", ""))
    return func in ("import_module", "__import__") and bool(node.args)


def _package_head(node: ast.AST) -> str | None:
    """`x.y` of an f-string that starts with the package `x.y.` (`f"x.y.{name}"`)."""
    if not isinstance(node, ast.JoinedStr) or not node.values:
        return None
    head = _constant_str(node.values[0])
    if head and head.endswith(".") and re.fullmatch(_DOTTED, head[:-1]):
        return head[:-1]
    return None


def _dynamic_import_target(node: ast.Call) -> str | None:
    """The module of `importlib.import_module(name[, package])` / `__import__(name)`: for an
    f-string name, the package it starts with."""
    if not _is_dynamic_import(node):
        return None
    func = getattr(node.func, "attr", getattr(node.func, "id", ""))
    name = _constant_str(node.args[0])
    if name is None:
        return _package_head(node.args[0])
    if func == "import_module" and name and name.startswith("."):
        package = _constant_str(node.args[1] if len(node.args) > 1 else None)
        for keyword in node.keywords:
            if keyword.arg == "package":
                package = _constant_str(keyword.value)
        if package is None:
            return None
        base = package.split(".")
        level = len(name) - len(name.lstrip("."))
        base = base[: len(base) - (level - 1)]
        return ".".join([*base, name.lstrip(".")] if name.lstrip(".") else base)
    return name


def _string_reference(node: ast.AST) -> str | None:
    """The module of a `"module:Name"` string (or of an f-string that starts with one)."""
    text = _constant_str(node)
    if text is not None:
        match = _REFERENCE.fullmatch(text)
        return match.group(1) if match else None
    if isinstance(node, ast.JoinedStr) and node.values:
        head = _constant_str(node.values[0])
        match = _REFERENCE_HEAD.fullmatch(head) if head else None
        return match.group(1) if match else None
    return None


def imported_modules(source: str) -> set[str]:
    """Every absolute module name `source` imports or references, in any of the forms above.
    `from x import y` yields both x and x.y (y may be a submodule)."""
    tree = ast.parse(source)
    f_string_parts = {
        id(part)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for part in node.values
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            names.add(_dynamic_import_target(node))
        elif id(node) not in f_string_parts:
            names.add(_string_reference(node))
    names.discard(None)
    return names


def run_time_imports(source: str) -> list[str]:
    """The `import_module(...)` / `__import__(...)` calls in `source` whose module the rule
    cannot read (see `_dynamic_import_target`)."""
    return sorted(
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and _is_dynamic_import(node)
        and _dynamic_import_target(node) is None
    )


def violations(source: str, forbidden: tuple[str, ...]) -> list[str]:
    """The names in `source` that are, or lie under, one of the `forbidden` modules."""
    return sorted(
        name
        for name in imported_modules(source)
        if any(name == f or name.startswith(f"{f}.") for f in forbidden)
    )


def _offenders(root: Path, forbidden: tuple[str, ...]) -> list[str]:
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for name in violations(path.read_text(), forbidden):
            offenders.append(f"{path.relative_to(root.parent)} imports {name}")
    return offenders


def test_atom_imports_no_host():
    offenders = _offenders(Path(atom.__file__).parent, HOSTS)
    assert not offenders, "\n".join(offenders)


def test_atom_names_every_module_it_imports():
    root = Path(atom.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in RUN_TIME_IMPORTS_ALLOWED:
            continue
        for call in run_time_imports(path.read_text()):
            offenders.append(f"{path.relative_to(root.parent)}: {call}")
    assert not offenders, "\n".join(offenders)


def test_run_time_import_allow_list_names_files_that_need_it():
    root = Path(atom.__file__).parent
    for allowed in RUN_TIME_IMPORTS_ALLOWED:
        assert run_time_imports((root / allowed).read_text()), allowed


@pytest.mark.parametrize("plugin", sorted(PLUGIN_SOURCES))
def test_plugins_import_no_engine_internals(plugin):
    root = PLUGIN_SOURCES[plugin]
    if not root.is_dir():
        pytest.skip(f"{plugin}'s sources are not in this checkout")
    offenders = _offenders(root, ATOM_INTERNAL)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        "import vllm",
        "import vllm.config as c",
        "import os, sglang",
        "from sglang.srt import server_args",
        "from atom_vllm import model",
        "def f():\n    import atom_sglang.model",
        "import importlib\nimportlib.import_module('atom_vllm.models')",
        "from importlib import import_module\nimport_module('vllm.v1')",
        "import importlib\nimportlib.import_module('.srt', package='sglang')",
        "import importlib\nimportlib.import_module('.model', 'atom_vllm')",
        "__import__('sglang')",
        "import importlib\nimportlib.import_module(f'vllm.model_executor.{name}')",
        "__import__(f'atom_sglang.{name}')",
        "ENTRY = 'atom_vllm.model:AtomForCausalLM'",
        "def ref(arch):\n    return f'atom_sglang.model:{arch}'",
    ],
)
def test_checker_catches_host_imports(source):
    assert violations(source, HOSTS)


@pytest.mark.parametrize(
    "source",
    [
        "import atom.engine",
        "import atom.engine.cuda_graphs",
        "from atom.engine.cuda_graphs import DecodeGraphs",
        "from atom import engine",
        "from atom.engine import llm as native",
        "class C:\n    def f(self):\n        from atom.engine.sampler import Sampler",
        "import importlib\nimportlib.import_module('atom.engine.model_runner')",
        "import importlib\nimportlib.import_module('.engine', 'atom')",
        "__import__('atom.engine.llm')",
        "MODELS = {'X': 'atom.engine.llm:LLM'}",
        "register('X', f'atom.engine.llm:{name}')",
    ],
)
def test_checker_catches_engine_imports(source):
    assert violations(source, ATOM_INTERNAL)


@pytest.mark.parametrize(
    "source",
    [
        "import importlib\nimportlib.import_module(name)",
        "from importlib import import_module\nimport_module(job['host'])",
        "__import__(name)",
        "import importlib\nimportlib.import_module(f'{package}.model')",
        "import importlib\nimportlib.import_module('.model', package)",
        "import importlib\nimportlib.import_module(name, 'atom_vllm')",
    ],
)
def test_checker_flags_imports_named_at_run_time(source):
    assert run_time_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "import importlib\nimportlib.import_module('atom.models.llama')",
        "import importlib\nimportlib.import_module(f'atom.models.{name}')",
        "import importlib\nimportlib.import_module('.model', 'atom_vllm')",
        "__import__('os')",
        "import os\nos.path.join(name)",
    ],
)
def test_checker_reads_imports_named_in_the_source(source):
    assert not run_time_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "import atom.cuda_graphs",
        "from atom.cuda_graphs import graph_blockers",
        "from atom import engines_guide",  # a name that only starts like the module
        "import atom_engine",
        "from . import engine",  # relative: inside the plugin, not atom's engine
        "NOTE = 'see atom.engine for the native engine'",  # prose, not a reference
        "URL = 'http://localhost:8000'",
        "import importlib\nimportlib.import_module(name)",  # not a constant: unknowable
    ],
)
def test_checker_passes_public_api(source):
    assert not violations(source, ATOM_INTERNAL)
    assert not violations(source, HOSTS)
