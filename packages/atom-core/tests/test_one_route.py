"""DESIGN.md §3, one route: each host's bridge puts the step's one complete
`AttentionMetadata` into ATOM's forward context, and ATOM's impls in the plugins read only
that. So no plugin module but the bridges imports its host's forward context or asks
the host for its attention backend (the sources are parsed, not imported: no host needs
to be installed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PLUGINS = {
    "atom_vllm": ROOT / "packages" / "atom-vllm" / "src" / "atom_vllm",
    "atom_sglang": ROOT / "packages" / "atom-sglang" / "src" / "atom_sglang",
}
HOST_STEP_LOOKUPS = {
    "atom_vllm": ("vllm.forward_context",),
    "atom_sglang": ("sglang.srt.model_executor.forward_context",),
}
# The modules that turn a host's step into ATOM's metadata and set ATOM's forward context.
BRIDGES = {"atom_vllm.step", "atom_sglang.model"}
# SGLang's forward-context getter of the step's backend object. (vLLM's
# `Attention.get_attn_backend()` only names a layer's backend class, which the wrapper and
# its report log: not a way to the step.)
BACKEND_GETTERS = {"atom_vllm": (), "atom_sglang": ("get_attn_backend",)}


def _modules(plugin: str):
    for path in sorted(PLUGINS[plugin].rglob("*.py")):
        relative = path.relative_to(PLUGINS[plugin]).with_suffix("")
        yield ".".join((plugin, *relative.parts)).removesuffix(".__init__"), path


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _host_step_lookups(plugin: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = [m for m in _imported(tree) if m.startswith(HOST_STEP_LOOKUPS[plugin])]
    found += [
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id in BACKEND_GETTERS[plugin])
        or (isinstance(node, ast.Attribute) and node.attr in BACKEND_GETTERS[plugin])
    ]
    return found


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_only_the_bridge_reads_the_hosts_step(plugin):
    offenders = {
        module: lookups
        for module, path in _modules(plugin)
        if module not in BRIDGES and (lookups := _host_step_lookups(plugin, path))
    }
    assert offenders == {}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_each_plugin_has_its_bridge(plugin):
    modules = dict(_modules(plugin))
    (bridge,) = [m for m in BRIDGES if m.startswith(f"{plugin}.")]
    source = modules[bridge].read_text()
    assert "set_forward_context" in source
