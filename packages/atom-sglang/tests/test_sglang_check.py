"""`atom bench check` through SGLang's CPU engine: every family SGLang serves with ATOM's
model, teacher-forced against HF transformers in float32 (the command the H100 runs in
bf16). The engines get the CPU workarounds through `sglang_cpu_support.engine_env`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import sglang_cpu_support

from atom.registry import all_models

pytestmark = pytest.mark.slow

SHAPES = [
    f"tiny-{entry.architecture}"
    for entry in all_models()
    if "sglang" in entry.hosts and entry.architecture.endswith("ForCausalLM")
]
CPU_ENGINE = dict(
    device="cpu", disable_cuda_graph="true", max_total_tokens=4096, mem_fraction_static=0.05
)


def test_every_sglang_family_passes_the_check(tmp_path):
    command = [sys.executable, "-m", "atom.cli", "bench", "check", "--device", "cpu"]
    command += ["--engines", "sglang-atom", "--shapes", ",".join(SHAPES), "--streams", "2x40"]
    for key, value in CPU_ENGINE.items():
        command += ["--sglang-option", f"{key}={value}"]
    command += ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    env = sglang_cpu_support.engine_env(tmp_path)
    env.pop("ATOM_DISABLE_SGLANG_PLUGIN", None)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "check.json").read_text())["rows"]
    assert {r["shape"] for r in rows} == set(SHAPES)
    assert all(r["engine"] == "sglang-atom" and r["reference"] == "hf-float32" for r in rows)
    assert all(r["passed"] and r["positions"] == 78 and r["top1_agreement"] == 1.0 for r in rows)
