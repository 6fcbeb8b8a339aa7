"""The engine on a CUDA device (Triton kernels) gives HF's greedy tokens for tiny fp32 models."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.kernels.policy import selected_backend
from atom.testing import tiny_config
from atom.testing.hf_references import skip_without_hf_reference
from tests.models.harness import (
    check_greedy_generation,
    make_prompts,
    write_checkpoint,
    write_with_random_vectors,
)
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES
from tests.models.test_glm4_moe import CASES as GLM_CASES
from tests.models.test_gpt_oss import CASES as GPT_OSS_CASES
from tests.models.test_llama import CASES as DENSE_CASES
from tests.models.test_minimax_m2 import CASES as MINIMAX_CASES
from tests.models.test_moe_models import CASES as MOE_CASES
from tests.models.test_qwen3_next import TEXT_MODELS, hybrid_config

CASES = {**DENSE_CASES, **MOE_CASES, **DEEPSEEK_CASES}

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize(
    "name",
    ["llama-gqa2", "qwen3-gqa2-tied", "qwen3-sliding-window", "qwen3-moe-top2-norm", "mixtral-top2"]
    + ["v2-greedy-no-qlora", "v3-grouped-qlora-dense1"],
)
def test_gpu_greedy_matches_hf(tmp_path, name, enforce_eager):
    assert selected_backend("paged_attention", "cuda") == "triton"
    check_greedy_on_gpu(write_checkpoint(CASES[name], tmp_path, init_std=0.1), enforce_eager)


def check_greedy_on_gpu(folder, enforce_eager: bool, **llm_kwargs) -> LLM:
    return check_greedy_generation(
        folder,
        prompt_lengths=[3, 11, 26, 70, 5, 9],
        max_new_tokens=16,
        device="cuda",
        enforce_eager=enforce_eager,
        max_num_seqs=8,
        **llm_kwargs,
    )


# The 2026 families' kernels on the GPU: sinks and 128-or-less windows (GPT-OSS), grouped
# sigmoid routing (GLM), QK-norm over all heads (MiniMax), and the Triton gated delta rule
# and causal conv1d with their state pools (the hybrids; decode graphs carry the slots).
NEW_FAMILIES = {
    **{f"gpt-oss-{name}": case for name, case in GPT_OSS_CASES.items()},
    "glm-4.5-dense1": GLM_CASES["glm-4.5-dense1"],
    "minimax-m2": MINIMAX_CASES["m2"],
    **{architecture: hybrid_config(architecture) for architecture in TEXT_MODELS},
}


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_gpu_new_families_greedy_match_hf(tmp_path, name, enforce_eager):
    check_greedy_on_gpu(write_with_random_vectors(NEW_FAMILIES[name], tmp_path), enforce_eager)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("architecture", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_gpu_sparse_attention_families_greedy_match_hf(tmp_path, architecture, enforce_eager):
    """DeepSeek Sparse Attention: prompts of up to 70 tokens against a top-8 selection;
    with graphs, the decode steps (indexer scores over the graphs' bound, its prefix top-k,
    sparse MLA) replay."""
    skip_without_hf_reference(architecture)
    folder = write_with_random_vectors(tiny_config(architecture), tmp_path)
    llm = check_greedy_on_gpu(folder, enforce_eager)
    graphs = llm.engine.executor.runner.decode_graphs
    assert (graphs is None) if enforce_eager else graphs.replays > 0


def test_gpu_graphs_and_async_scheduling_equal_eager_and_seeds_reproduce(tmp_path):
    """Decode graphs padded to captured sizes (37 sequences -> 48, then fewer as they
    finish at different lengths) and async scheduling (steps fed by the previous step's
    tokens on the device) give eager synchronous tokens; seeded sampling repeats."""
    folder = write_checkpoint(CASES["qwen3-gqa2-tied"], tmp_path, init_std=0.1)
    prompts = make_prompts(256, [3 + (7 * i) % 40 for i in range(37)], seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=4 + i % 13, ignore_eos=True)
        for i in range(len(prompts))
    ]
    runs = {}
    for eager, overlap in [(True, False), (False, False), (False, True), (True, True)]:
        llm = LLM(
            str(folder),
            dtype="float32",
            device="cuda",
            skip_tokenizer_init=True,
            enforce_eager=eager,
            async_scheduling=overlap,
            max_num_seqs=64,
            kv_cache_memory_bytes=64 << 20,
        )
        assert (llm.engine.executor.runner.decode_graphs is None) == eager
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[eager, overlap] = [o.outputs[0].token_ids for o in outputs]
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
        first, second = (
            llm.generate(prompts[:3], seeded, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(2)
        )
        assert first == second
        del llm
    assert all(run == runs[True, False] for run in runs.values())
