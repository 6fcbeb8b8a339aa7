"""One route (docs/architecture.md, "A decode step, host by host"): each host's bridge
puts the step's one complete `AttentionMetadata` into ATOM's forward context (or, where
the host's own backend attends, that step's `HostAttention`), and ATOM's impls in the
plugins read only that. So no plugin module but the bridges imports its host's forward
context or asks the host for its attention backend, no ATOM layer names a host's batch,
and ATOM's forward context has no slot a host object could ride in on (the sources are
parsed, not imported: no host needs to be installed)."""

from __future__ import annotations

import ast
import inspect
import typing
from dataclasses import fields
from pathlib import Path

import pytest

import atom
from atom.forward_context import (
    AttentionMetadata,
    ForwardContext,
    HostAttention,
    set_forward_context,
)

ROOT = Path(__file__).resolve().parents[3]
PLUGINS = {
    "atom_vllm": ROOT / "packages" / "atom-vllm" / "src" / "atom_vllm",
    "atom_sglang": ROOT / "packages" / "atom-sglang" / "src" / "atom_sglang",
}
PACKAGES = {"atom": Path(atom.__file__).parent, **PLUGINS}
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
# The hosts' per-step batch objects, by class and by the name their APIs give them.
HOST_BATCH_NAMES = {
    "ForwardBatch", "forward_batch", "CommonAttentionMetadata", "common_attn_metadata",
}  # fmt: skip
# Where a host hands over its batch: the bridges, and the host backend classes and
# builders that turn it into ATOM's metadata.
BATCH_TAKERS = BRIDGES | {"atom_vllm.backend", "atom_sglang.backend", "atom_sglang.metadata"}


def _modules(package: str):
    root = PACKAGES[package]
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).with_suffix("")
        yield ".".join((package, *relative.parts)).removesuffix(".__init__"), path


def _host_batch_names(path: Path) -> set[str]:
    """Names of a host's batch the code uses (parameters, variables, attributes)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        name = (
            node.arg if isinstance(node, ast.arg)
            else node.id if isinstance(node, ast.Name)
            else node.attr if isinstance(node, ast.Attribute)
            else None
        )  # fmt: skip
        if name in HOST_BATCH_NAMES:
            found.add(name)
    return found


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


def test_no_atom_layer_names_a_hosts_batch():
    """A host's batch reaches only its bridge and the builder it feeds; atom-core and the
    plugins' layers never hold it (atom_sglang's runtime check: test_sglang_one_route)."""
    offenders = {
        module: names
        for package in sorted(PACKAGES)
        for module, path in _modules(package)
        if module not in BATCH_TAKERS and (names := _host_batch_names(path))
    }
    assert offenders == {}


def test_the_forward_context_carries_only_atoms_step():
    """No untyped slot (the `extras` dict SGLang's batch once rode in): ATOM's metadata,
    or the host's own attention behind ATOM's `HostAttention` protocol."""
    hints = typing.get_type_hints(ForwardContext)
    assert {f.name: hints[f.name] for f in fields(ForwardContext)} == {
        "attn_metadata": AttentionMetadata | None,
        "host_attention": HostAttention | None,
    }
    parameters = inspect.signature(set_forward_context.__wrapped__).parameters.values()
    assert all(p.kind is not p.VAR_KEYWORD for p in parameters)


def test_a_step_has_one_attention_route():
    metadata = AttentionMetadata.build([1], [3], [[0]], [2])
    both = set_forward_context(metadata, host_attention=lambda *a, **k: None)
    with pytest.raises(ValueError, match="not both"), both:
        pass
