"""`atom bench check` through SGLang's CPU engine: every family SGLang serves with ATOM's
model, teacher-forced against HF transformers in float32 (the command the H100 runs in
bf16). The engines get the CPU workarounds through `sglang_cpu_support.engine_env`."""

from __future__ import annotations

import os

import pytest
import sglang_cpu_support

from atom.registry import all_models
from atom.testing import tiny_config
from atom.testing.bench_check import run_check

pytestmark = pytest.mark.slow

CPU_ENGINE = dict(
    device="cpu", disable_cuda_graph="true", max_total_tokens=4096, mem_fraction_static=0.05
)
# Gated DeltaNet families, as test_sglang_hybrid.py runs them: without FLA, SGLang's mamba
# radix cache needs no_buffer and no overlap schedule, and the conv state must be fp32.
HYBRID_ENGINE = CPU_ENGINE | dict(
    mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule="true"
)
HYBRID_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


def _shapes(hybrid: bool) -> list[str]:
    # The sparse-attention families run end to end in test_sglang_sparse.py (an engine
    # start each there; CI's time budget has no room for a second one here).
    return [
        f"tiny-{entry.architecture}"
        for entry in all_models()
        if "sglang" in entry.hosts
        and entry.architecture.endswith("ForCausalLM")
        and entry.hybrid == hybrid
        and getattr(tiny_config(entry.architecture), "index_topk", None) is None
    ]


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_every_sglang_family_passes_the_check(tmp_path, hybrid):
    shapes = _shapes(hybrid)
    options = []
    for key, value in (HYBRID_ENGINE if hybrid else CPU_ENGINE).items():
        options += ["--sglang-option", f"{key}={value}"]
    env = sglang_cpu_support.engine_env(tmp_path) | (HYBRID_ENV if hybrid else {})
    env.pop("ATOM_DISABLE_SGLANG_PLUGIN", None)
    # One command per core, each engine on one thread, as sglang_harness runs its jobs.
    processes = min(2, os.cpu_count() or 1)
    envs = [env | {"OMP_NUM_THREADS": "1"}] * processes if processes > 1 else [env]
    rows = run_check(shapes, "sglang-atom", options, tmp_path, envs)
    assert sorted(r["shape"] for r in rows) == sorted(shapes)
    assert all(r["engine"] == "sglang-atom" and r["reference"] == "hf-float32" for r in rows)
    assert all(r["passed"] and r["positions"] == 78 and r["top1_agreement"] == 1.0 for r in rows)
