"""4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) under
SGLang's CPU engine (0.5.21, 0.5.23) with atom-sglang: ATOM serves each with the greedy tokens of the
plain checkpoint holding the weights it stands for (`atom.testing.w4a16`), also under ATOM.

SGLang checks the activation dtype against its own config of the method
(sglang/srt/model_loader/loader.py `_get_quantization_config`): on CPU an AWQ checkpoint
resolves to "awq" and a GPTQ one to "gptq" (their marlin forms need CUDA), which take
float16 only; compressed-tensors takes float16 / bfloat16. So AWQ and GPTQ run in fp16,
compressed-tensors in bf16, each next to its reference in the same dtype (ATOM
dequantizes in fp32 and rounds once: the same weights as the reference checkpoint).
"""

from __future__ import annotations

import pytest
from sglang_harness import ENGINE, Run, result_of, rounds, run_jobs

from atom.testing.w4a16 import Scheme, write_w4a16_pair
from atom_sglang import served_architectures

pytestmark = pytest.mark.slow

ARCH = "Qwen3ForCausalLM"
ATOM = {**ENGINE, "attention_backend": "atom"}
SCHEMES = {
    "awq": (Scheme("awq", 64), "float16"),
    "gptq": (Scheme("gptq", 32, act_order=True), "float16"),
    "compressed-tensors": (Scheme("compressed-tensors", -1, symmetric=True), "bfloat16"),
}


def seed_of(fmt: str) -> int:
    return 40 + list(SCHEMES).index(fmt)


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    if ARCH not in served_architectures():
        pytest.skip(f"ATOM's {ARCH} is not available")
    folder = tmp_path_factory.mktemp("w4a16")
    jobs: list[list[Run]] = [[], []]
    for fmt, (scheme, dtype) in SCHEMES.items():
        quantized, reference = write_w4a16_pair(checkpoints(ARCH), folder, scheme)
        engine = {**ATOM, "dtype": dtype}
        # One process per core: each runs a quantized engine and its reference in turn.
        jobs[0].append(Run(fmt, quantized, engine, rounds(seed_of(fmt))))
        jobs[1].append(Run(f"{fmt}-reference", reference, engine, rounds(seed_of(fmt))))
    return run_jobs(jobs, tmp_path_factory.mktemp("sglang-w4a16"))


@pytest.mark.parametrize("fmt", list(SCHEMES))
def test_quantized_checkpoint_gives_the_dequantized_tokens(runs, fmt):
    result = result_of(runs, fmt)
    assert f"quant={fmt}" in result.log  # ATOM built the model with its 4-bit layers
    reference = result_of(runs, f"{fmt}-reference")
    for name, got in result.rounds.items():
        want = reference.rounds[name]
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want], name
