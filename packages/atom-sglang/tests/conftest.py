"""Fixtures of the atom-sglang tests (helpers: sglang_harness.py, sglang_cpu_support.py)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:  # these tests need SGLang 0.5.21 or 0.5.23
    collect_ignore_glob = ["test_*.py"]
else:
    import sglang_cpu_support

    # Before anything imports transformers / torchvision / SGLang in this process.
    sglang_cpu_support.install()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts real SGLang engines (20-45 s each)")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Callable[[str], Path]:
    """checkpoints(arch) -> folder of a tiny random checkpoint, written once per session."""
    from atom.testing import host_checkpoints

    return host_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture
def fresh_plugin(monkeypatch):
    """register() as in a new process; SGLang's registries restored afterwards."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    import atom_sglang
    from atom_sglang import guard

    models = dict(ModelRegistry.models)
    backends = dict(ATTENTION_BACKENDS)
    choices = list(ATTENTION_BACKEND_CHOICES)
    steps = {name: list(hooks) for name, hooks in resolution_hooks._HOOKS.items()}
    host_hooks = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    monkeypatch.setattr(atom_sglang, "_registered", None)
    monkeypatch.setattr(guard, "_installed", False)
    for name in ("ATOM_DISABLE_SGLANG_PLUGIN", "ATOM_SGLANG_BACKEND_ONLY"):
        monkeypatch.delenv(name, raising=False)
    yield
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    ATTENTION_BACKENDS.clear()
    ATTENTION_BACKENDS.update(backends)
    ATTENTION_BACKEND_CHOICES[:] = choices
    resolution_hooks._HOOKS.clear()
    resolution_hooks._HOOKS.update(steps)
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(host_hooks)


@pytest.fixture
def root_logging():
    """SGLang's launch paths reconfigure the root logger (basicConfig(force=True))."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


UNSUPPORTED_VERSION = "0.5.17"


@pytest.fixture
def unsupported_sglang(fresh_plugin, monkeypatch):
    """The installed SGLang as register() sees it: 0.5.17, below the tested range."""
    import atom_sglang

    monkeypatch.setattr(atom_sglang, "sglang_version", lambda: UNSUPPORTED_VERSION)
