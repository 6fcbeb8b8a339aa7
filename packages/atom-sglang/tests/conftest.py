"""Fixtures of the atom-sglang tests (helpers: sglang_harness.py, sglang_cpu_support.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:  # these tests need SGLang 0.5.21
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
