"""Triton kernels read module globals only as `tl.constexpr` values: a compiled kernel
refuses any other (Triton 3.6 on the H100: "Cannot access global variable ... from within
@jit'ed function"), while the interpreter the CPU tests use lets it pass. This reads every
Triton module's source, so the mistake fails here rather than on the first GPU run."""

from __future__ import annotations

import ast
from pathlib import Path

import atom.kernels

# Read as text: no Triton needed.
SOURCES = sorted((Path(atom.kernels.__file__).parent / "triton").glob("*.py"))


def is_constexpr(value: ast.expr) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "constexpr"
    )


def is_jit(function: ast.FunctionDef) -> bool:
    def name(decorator: ast.expr) -> str:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")

    return any(name(decorator) == "jit" for decorator in function.decorator_list)


def plain_globals_read_by_kernels(source: str) -> list[str]:
    tree = ast.parse(source)
    plain = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not is_constexpr(node.value):
                plain |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and is_jit(node):
            own = {a.arg for a in node.args.args + node.args.kwonlyargs}
            own |= {
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
            read = {
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            }
            found += [f"{node.name} reads {name}" for name in sorted((read - own) & plain)]
    return found


def test_the_check_catches_a_plain_global():
    source = "import triton\nLIMIT = 20.0\n@triton.jit\ndef k(x):\n    return x > LIMIT\n"
    assert plain_globals_read_by_kernels(source) == ["k reads LIMIT"]
    fixed = source.replace("LIMIT = 20.0", "LIMIT = tl.constexpr(20.0)")
    assert plain_globals_read_by_kernels(fixed) == []


def test_triton_kernels_read_only_constexpr_globals():
    assert len(SOURCES) > 10
    offenders = {
        path.name: found
        for path in SOURCES
        if (found := plain_globals_read_by_kernels(path.read_text()))
    }
    assert not offenders, offenders
