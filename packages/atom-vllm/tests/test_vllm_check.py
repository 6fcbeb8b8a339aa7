"""`atom bench check` through vLLM on the CPU: every family vLLM serves with ATOM's model,
teacher-forced against HF transformers in float32 (the command the H100 runs in bf16)."""

from __future__ import annotations

import pytest
from vllm_harness import engine_cores, engine_env

from atom.registry import all_models
from atom.testing import tiny_config
from atom.testing.bench_check import run_check

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
    options = ["--vllm-option", f"kv_cache_memory_bytes={32 << 20}"]
    options += ["--vllm-option", "enforce_eager=true"]
    envs = [engine_env(tmp_path, {}, core) for core in engine_cores()]
    rows = run_check(SHAPES, "vllm-atom", options, tmp_path, envs)
    assert sorted(r["shape"] for r in rows) == sorted(SHAPES)
    assert all(r["engine"] == "vllm-atom" and r["reference"] == "hf-float32" for r in rows)
    assert all(r["passed"] and r["positions"] == 78 and r["top1_agreement"] == 1.0 for r in rows)
