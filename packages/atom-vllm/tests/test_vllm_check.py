"""`atom bench check` through vLLM on the CPU: every family vLLM serves with ATOM's model,
teacher-forced against HF transformers in float32 (the command the H100 runs in bf16)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from atom.registry import all_models
from atom.testing import tiny_config

pytestmark = pytest.mark.slow

# The sparse-attention families run end to end in test_vllm_sparse.py (an engine start
# each there; CI's time budget has no room for a second one here).
SHAPES = [
    f"tiny-{entry.architecture}"
    for entry in all_models()
    if "vllm" in entry.hosts
    and entry.architecture.endswith("ForCausalLM")
    and getattr(tiny_config(entry.architecture), "index_topk", None) is None
]


def test_every_vllm_family_passes_the_check(tmp_path):
    command = [sys.executable, "-m", "atom.cli", "bench", "check", "--device", "cpu"]
    command += ["--engines", "vllm-atom", "--shapes", ",".join(SHAPES), "--streams", "2x40"]
    command += ["--vllm-option", f"kv_cache_memory_bytes={32 << 20}"]
    command += ["--vllm-option", "enforce_eager=true"]
    command += ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "check.json").read_text())["rows"]
    assert {r["shape"] for r in rows} == set(SHAPES)
    assert all(r["engine"] == "vllm-atom" and r["reference"] == "hf-float32" for r in rows)
    assert all(r["passed"] and r["positions"] == 78 and r["top1_agreement"] == 1.0 for r in rows)
