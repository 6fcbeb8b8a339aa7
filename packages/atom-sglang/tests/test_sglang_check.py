"""`atom bench check` through SGLang's CPU engine: every family SGLang serves with ATOM's
model, teacher-forced against HF transformers in float32 (the command the H100 runs in
bf16).

The families are checked inside the engine runs that already serve their checkpoints
(`check=True`: test_sglang_engine.py, test_sglang_hybrid.py), an engine start each less
than the command's own; the command itself runs here end to end on one of them, with the
CPU workarounds of `sglang_cpu_support.engine_env`. The sparse-attention families run end
to end in test_sglang_sparse.py.
"""

from __future__ import annotations

import pytest
import sglang_cpu_support
import test_sglang_engine
import test_sglang_hybrid

from atom.registry import all_models
from atom.testing import tiny_config
from atom.testing.bench_check import run_check

pytestmark = pytest.mark.slow

CPU_ENGINE = dict(
    device="cpu", disable_cuda_graph="true", max_total_tokens=4096, mem_fraction_static=0.05
)
FAMILIES = {
    entry.architecture
    for entry in all_models()
    if "sglang" in entry.hosts
    and entry.architecture.endswith("ForCausalLM")
    and getattr(tiny_config(entry.architecture), "index_topk", None) is None
}


def test_every_sglang_family_is_checked():
    checked = {*test_sglang_engine.ARCHS, *test_sglang_hybrid.HYBRIDS}
    assert checked >= FAMILIES, FAMILIES - checked


def test_the_check_command_passes_through_sglang(tmp_path):
    options = []
    for key, value in CPU_ENGINE.items():
        options += ["--sglang-option", f"{key}={value}"]
    env = sglang_cpu_support.engine_env(tmp_path) | {"OMP_NUM_THREADS": "1"}
    env.pop("ATOM_DISABLE_SGLANG_PLUGIN", None)
    shape = "tiny-Qwen3MoeForCausalLM"
    (row,) = run_check([shape], "sglang-atom", options, tmp_path, [env])
    assert row["shape"] == shape and row["engine"] == "sglang-atom"
    assert row["reference"] == "hf-float32"
    assert row["passed"] and row["positions"] == 78 and row["top1_agreement"] == 1.0
