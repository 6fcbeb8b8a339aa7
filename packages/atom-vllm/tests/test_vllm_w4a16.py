"""4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) under
vllm.LLM with the plugin: ATOM serves each with the greedy tokens of the plain checkpoint
holding the weights it stands for (`atom.testing.w4a16`), also under ATOM.

vLLM takes AWQ and GPTQ activations in fp16 / bf16 only (vllm/config/vllm.py checks the
method's get_supported_act_dtypes), so those run in bf16 next to their reference in bf16
(ATOM dequantizes in fp32 and rounds once: the same bf16 weights as the reference); the
compressed-tensors one runs in fp32 against HF. vLLM 0.32's GPTQ config refuses, before
the plugin is asked, asymmetric checkpoints (AutoGPTQConfig.TYPE_MAP, vllm/model_executor/
layers/quantization/auto_gptq.py:152) and act-order ones (desc_act with groups,
.../quantization/utils/gptq_utils.py:32): ATOM's act-order is covered by the core tests.
"""

from __future__ import annotations

import pytest
from vllm_harness import ENGINE, Job, result_of, rounds, run_jobs

from atom.testing import hf_greedy
from atom.testing.w4a16 import Scheme, write_w4a16_pair
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

ARCH = "Qwen3ForCausalLM"
BF16 = {**ENGINE, "model_impl": "atom", "dtype": "bfloat16"}
FP32 = {**ENGINE, "model_impl": "atom"}
SCHEMES = {
    "awq": (Scheme("awq", 32), BF16),
    "gptq": (Scheme("gptq", 64, symmetric=True), BF16),
    "compressed-tensors": (Scheme("compressed-tensors", 128), FP32),
}


@pytest.fixture(scope="module")
def pairs(checkpoints, tmp_path_factory):
    if ARCH not in served_architectures():
        pytest.skip(f"ATOM's {ARCH} is not available")
    folder = tmp_path_factory.mktemp("w4a16")
    return {
        fmt: write_w4a16_pair(checkpoints(ARCH), folder, scheme)
        for fmt, (scheme, _) in SCHEMES.items()
    }


@pytest.fixture(scope="module")
def runs(pairs, tmp_path_factory):
    jobs = []
    for i, (fmt, (_, engine)) in enumerate(SCHEMES.items()):
        quantized, reference = pairs[fmt]
        jobs.append(Job(fmt, quantized, engine, rounds(20 + i)))
        if engine is BF16:
            jobs.append(Job(f"{fmt}-reference", reference, engine, rounds(20 + i), probe=False))
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-w4a16"))


def tokens(result, round_name: str) -> list[list[int]]:
    return [r["token_ids"] for r in result.rounds[round_name]]


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_quantized_checkpoint_gives_the_dequantized_tokens(runs, pairs, fmt):
    result = result_of(runs, fmt)
    assert f"quant={fmt}" in result.log  # ATOM built the model with its 4-bit layers
    for spec in rounds(20 + list(SCHEMES).index(fmt)):
        got = tokens(result, spec["name"])
        if SCHEMES[fmt][1] is BF16:
            want = tokens(result_of(runs, f"{fmt}-reference"), spec["name"])
        else:
            want = hf_greedy(pairs[fmt][1], spec["prompts"], 8)
        assert got == want, f"{fmt} round {spec['name']!r}: {got} != {want}"
