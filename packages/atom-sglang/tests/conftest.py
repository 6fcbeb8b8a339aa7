"""Fixtures of the atom-sglang tests (helpers: sglang_harness.py, sglang_cpu_support.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:  # these tests need SGLang 0.5.17
    collect_ignore_glob = ["test_*.py"]
else:
    import sglang_cpu_support

    # Before anything imports transformers / torchvision / SGLang in this process.
    sglang_cpu_support.install()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts real SGLang engines (20-45 s each)")


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
