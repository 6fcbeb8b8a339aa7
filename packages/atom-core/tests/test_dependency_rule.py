"""DESIGN.md §1: `atom` never imports a host or a host plugin."""

from __future__ import annotations

import ast
from pathlib import Path

import atom

FORBIDDEN = ("vllm", "sglang", "atom_vllm", "atom_sglang")


def _dynamic_import_target(node: ast.Call) -> str | None:
    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and _dynamic_import_target(node):
            names.add(_dynamic_import_target(node))
    return names


def test_atom_imports_no_host():
    root = Path(atom.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for name in imported_modules(path.read_text()):
            if name.split(".")[0] in FORBIDDEN:
                offenders.append(f"{path.relative_to(root.parent)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_checker_catches_host_imports():
    source = "import vllm\nfrom sglang.srt import x\nimportlib.import_module('atom_vllm.models')\n"
    assert {"vllm", "sglang.srt", "atom_vllm.models"} <= imported_modules(source)
