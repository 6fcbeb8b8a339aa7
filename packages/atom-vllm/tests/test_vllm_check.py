"""`atom bench check` through vLLM on the CPU: every family vLLM serves with ATOM's model,
teacher-forced against HF transformers in float32 (the command the H100 runs in bf16).

The families are checked inside the engine jobs that already run their checkpoints
(`check=True`: test_vllm_llm.py, test_vllm_deepseek.py, test_vllm_hybrid.py), an engine
start each less than the command's own; the command itself runs here end to end on one
of them. The sparse-attention families run end to end in test_vllm_sparse.py.
"""

from __future__ import annotations

import pytest
import test_vllm_deepseek
import test_vllm_hybrid
import test_vllm_llm
from vllm_harness import engine_cores, engine_env

from atom.registry import all_models
from atom.testing import tiny_config
from atom.testing.bench_check import run_check

pytestmark = pytest.mark.slow

FAMILIES = {
    entry.architecture
    for entry in all_models()
    if "vllm" in entry.hosts
    and entry.architecture.endswith("ForCausalLM")
    and getattr(tiny_config(entry.architecture), "index_topk", None) is None
}
CHECKED_IN_ENGINE_JOBS = {
    *test_vllm_llm.CANDIDATES, *test_vllm_deepseek.CASES, *test_vllm_hybrid.HYBRIDS
}  # fmt: skip


def test_every_vllm_family_is_checked():
    assert FAMILIES <= CHECKED_IN_ENGINE_JOBS, FAMILIES - CHECKED_IN_ENGINE_JOBS


def test_the_check_command_passes_through_vllm(tmp_path):
    options = ["--vllm-option", f"kv_cache_memory_bytes={32 << 20}"]
    options += ["--vllm-option", "enforce_eager=true"]
    envs = [engine_env(tmp_path, {}, engine_cores()[0])]
    shape = "tiny-Qwen3MoeForCausalLM"
    (row,) = run_check([shape], "vllm-atom", options, tmp_path, envs)
    assert row["shape"] == shape and row["engine"] == "vllm-atom"
    assert row["reference"] == "hf-float32"
    assert row["passed"] and row["positions"] == 78 and row["top1_agreement"] == 1.0
