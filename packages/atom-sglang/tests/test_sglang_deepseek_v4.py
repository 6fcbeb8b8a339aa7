"""DeepSeek-V4 on SGLang's CPU engine (0.5.21, 0.5.23) with atom-sglang's compressed-
attention layer, against HF transformers' greedy decoding of the same checkpoint in fp32.

SGLang's own DeepSeek-V4 path (its compressed pools and kernels) does not run on its CPU
engine, so atom-sglang keeps the model off it and gives ATOM's layers SGLang's plain MLA
pool, each row one token's packed page of every tensor the layer keeps
(`atom_sglang.patches`, changes 11 and 12). The tiny config has one sliding (window 16),
one CSA (an entry every 4 tokens, the indexer keeping the top 4) and one HCA layer (an
entry every 16 tokens). The longest prompt runs past 4x the top-k CSA entries, the window
and several HCA windows, prefilled in chunks of 64; the shared prefix (K = V rows,
compressor rows and compressed entries of all three layers) comes from SGLang's radix
cache. ONE engine runs every case (an engine start costs 20-45 s here).
"""

from __future__ import annotations

import pytest
from sglang_harness import ENGINE, MAX_TOKENS, Run, result_of, run_jobs

from atom.testing import hf_greedy, random_prompts, tiny_config
from atom_sglang import served_architectures

pytestmark = pytest.mark.slow

ARCH = "DeepseekV4ForCausalLM"
TINY = tiny_config(ARCH)
CSA_RATE, HCA_RATE = (
    TINY.compress_rates[kind]
    for kind in ("compressed_sparse_attention", "heavily_compressed_attention")
)
CHUNK = ENGINE["chunked_prefill_size"]
# Past 4x the top-k CSA entries, the window and several HCA windows; chunked.
LONG = [5, 4 * TINY.index_topk * CSA_RATE + 6, 2 * CHUNK + 37]
PREFIX = 4 * HCA_RATE + 3  # ends inside a CSA and an HCA window
ENGINE_V4 = {**ENGINE, "attention_backend": "atom"}


def v4_rounds(seed: int = 60) -> list[dict]:
    prefix = random_prompts([PREFIX], seed + 1)[0]
    suffixes = random_prompts([5, 1, 7, 20], seed + 2)
    return [
        {"name": "long", "prompts": random_prompts(LONG, seed)},
        {"name": "prefix_warm", "prompts": [prefix + suffixes[0]]},
        {"name": "prefix_reuse", "prompts": [prefix + s for s in suffixes[1:]]},
    ]


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    job = Run(ARCH, checkpoints(ARCH), ENGINE_V4, v4_rounds())
    return result_of(run_jobs([[job]], tmp_path_factory.mktemp("sglang-v4")), ARCH)


def test_rounds_reach_every_part():
    assert TINY.layer_types == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    ]  # fmt: skip
    assert max(LONG) > CHUNK and max(LONG) >= 4 * TINY.index_topk * CSA_RATE
    assert max(LONG) > 2 * TINY.sliding_window and max(LONG) > 4 * HCA_RATE
    assert TINY.sliding_window < PREFIX and PREFIX % CSA_RATE and PREFIX % HCA_RATE


def test_greedy_tokens_equal_hf_with_chunks_and_a_prefix_hit(run, checkpoints):
    assert ARCH in served_architectures()
    for spec in v4_rounds():
        got = [r["token_ids"] for r in run.rounds[spec["name"]]]
        want = hf_greedy(checkpoints(ARCH), spec["prompts"], MAX_TOKENS)
        assert got == want, f"round {spec['name']!r}: SGLang+ATOM {got} != HF {want}"
    cached = [r["cached_tokens"] for r in run.rounds["prefix_reuse"]]
    assert all(c >= PREFIX for c in cached), f"prefix not reused: cached_tokens={cached}"


def test_each_layer_is_atoms_impl_over_packed_mla_rows(run):
    assert "built for SGLang: 3 compressed attention layers, kv pool mla" in run.log
    assert "ATOM attention backend: MLA pool" in run.log
    # Per token at page size 1: every layer's K = V; CSA and HCA their compressor rows and
    # one entry; CSA its indexer's too (fp32). The pool's rows are the widest layer's
    # (CSA: 32 + 2 x 128 + 32 + 32 channels) in each of the 3 layers.
    assert "B per token (" in run.log and "B compressor entries" in run.log
    assert f"SGLang's MLA pool rows hold {3 * 352 * 4} B per token" in run.log
