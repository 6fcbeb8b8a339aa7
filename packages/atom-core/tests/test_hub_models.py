"""A model given as a hub id resolves through huggingface_hub's cache, offline included:
the cache here is laid out by hand, as huggingface_hub writes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import atom
from atom.demo import write_demo_model
from atom.hub import resolve_model_path

REPO_ID = "atom-tests/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """HF_HUB_CACHE/models--atom-tests--tiny-llama: refs/main names a snapshot whose files
    link to blobs."""
    checkpoint = write_demo_model(tmp_path_factory.mktemp("checkpoint"))
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for i, file in enumerate(sorted(checkpoint.iterdir())):
        blob = repo / "blobs" / f"blob{i:040d}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return cache


def test_a_local_folder_stays_itself(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_atom_generate_serves_a_hub_id_from_the_cache_offline(hub_cache):
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(atom.__file__).parents[1])}  # fmt: skip
    command = [sys.executable, "-m", "atom.cli", "generate", REPO_ID, "--prompt", "a",
               "--max-tokens", "3", "--dtype", "float32"]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    missing = subprocess.run([*command[:4], "atom-tests/absent", *command[5:]], env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode != 0
    assert "not in the Hugging Face cache" in missing.stderr
