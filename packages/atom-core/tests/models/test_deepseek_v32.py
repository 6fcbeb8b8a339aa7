"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) against HF transformers in fp32.

The tiny configs keep the top 8 tokens per query (atom.testing), and the prompts run to
40 tokens and decode past them, so most queries attend to a fifth of what they see and a
wrong selection shows in the logits (`test_the_selection_matters` checks that it would).
"""

from __future__ import annotations

import json

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import ConfigError, ModelConfig
from atom.engine.model_runner import build_model
from atom.testing import hf_greedy, random_prompts, tiny_config
from atom.testing.hf_references import skip_without_hf_reference
from tests.models.harness import (
    check_against_hf,
    hf_logits,
    load_hf,
    write_checkpoint,
    write_with_random_vectors,
)

ARCHITECTURES = ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"]
TOPK = tiny_config("DeepseekV32ForCausalLM").index_topk
LONG = [5, 40, 4 * TOPK + 1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    skip_without_hf_reference(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    return write_with_random_vectors(tiny_config(request.param), folder)


def test_logits_match_hf(checkpoint):
    check_against_hf(checkpoint, prompt_lengths=LONG, decode_steps=6)


def test_cached_prefix_matches_hf(checkpoint):
    # The prefix's indexer keys come back from the cache for the rest of the prompt.
    check_against_hf(checkpoint, prompt_lengths=[40, 9], decode_steps=2, cached_prefix=21)


def test_the_selection_matters(checkpoint, tmp_path):
    """HF with every token selected gives other logits on these prompts: the parity tests
    above see the sparse selection."""
    prompt = random_prompts([40], seed=5)[0]
    sparse = hf_logits(load_hf(checkpoint), prompt)
    dense_config = tiny_config(load_hf(checkpoint).config.architectures[0], index_topk=64)
    dense = write_with_random_vectors(dense_config, tmp_path)
    assert (hf_logits(load_hf(dense), prompt)[4 * TOPK :] - sparse[4 * TOPK :]).abs().max() > 1e-2


def engine(checkpoint, **kwargs) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts([36], seed=9)[0]
    return [shared + [7, 8, 9], random_prompts([3], seed=2)[0], shared + [11]]


@pytest.fixture(scope="module")
def expected(checkpoint, prompts):
    return hf_greedy(checkpoint, prompts, GREEDY.max_tokens)


def test_engine_chunked_prefill_and_prefix_hits_equal_hf(checkpoint, prompts, expected):
    llm = engine(checkpoint, block_size=4, max_num_batched_tokens=16)
    first = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    last = llm.generate(prompts[2:], GREEDY, use_tqdm=False)
    assert tokens(first + last) == expected
    assert last[0].num_cached_tokens == 36  # the shared prefix: latents and indexer keys
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_engine_preemption_equals_hf(checkpoint, prompts, expected):
    # 14 blocks of 4 tokens: the first long prompt and the short one grow to 12 + 3
    # blocks, so the short one is preempted and recomputed, indexer keys included.
    llm = engine(checkpoint, block_size=4, num_blocks=14, enable_prefix_caching=False)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks


def test_startup_summary_counts_indexer_keys(checkpoint):
    config = load_hf(checkpoint).config
    llm = engine(checkpoint, block_size=4, num_blocks=8)
    indexing = config.indexer_types.count("full") if hasattr(config, "indexer_types") else 2
    latents = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    keys = indexing * config.index_head_dim * 4
    summary = llm.engine.kv_cache_summary()
    assert f"{latents + keys} B per token ({latents} B MLA latents + {keys} B indexer keys)" in (
        summary
    )


def test_selection_is_reused_by_shared_layers_only(checkpoint):
    config = load_hf(checkpoint).config
    llm = engine(checkpoint, block_size=4, num_blocks=8)
    kinds = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
    layers = llm.engine.model.model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [
        kind == "full" for kind in kinds
    ]
    assert all(layer.self_attn.attn.spec.index_topk == TOPK for layer in layers)
    assert torch.is_tensor(layers[0].self_attn.attn.index_cache)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("scoring_func", "relu", "config field scoring_func='relu' is not supported"),
        ("topk_method", "hash", "config field topk_method='hash' is not supported"),
        ("indexer_types", ["full", "compressed"], "config field indexer_types has ['compressed']"),
        ("indexer_types", ["shared", "full"], "config field indexer_types=['shared', 'full']"),
        ("index_topk", 0, "config field index_topk=0 must be >= 1"),
        ("index_head_dim", 8, "config field index_head_dim=8 must be even and hold"),
    ],
)
def test_variant_atom_lacks_fails_at_load_naming_the_field(tmp_path, field, value, message):
    skip_without_hf_reference("DeepseekV32ForCausalLM")
    folder = write_checkpoint(tiny_config("DeepseekV32ForCausalLM", num_hidden_layers=2), tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as error:
        build_model(ModelConfig.from_pretrained(folder), "cpu", progress=False)
    assert message in str(error.value) and "\n" not in str(error.value)
