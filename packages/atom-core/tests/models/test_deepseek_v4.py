"""DeepSeek-V4 against HF transformers in fp32.

The tiny config has one layer of each attention kind: sliding (window 16), CSA (an entry
every 4 tokens with overlap, the indexer keeping the top 4) and HCA (an entry every 16
tokens); its first MoE layer is hash-routed. The long prompts (70 tokens: 17 CSA entries,
over 4x the top-k, 4 HCA entries, past the window) make every part count, and
`test_the_selection_matters` checks that a wrong selection would show.
"""

from __future__ import annotations

import json

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import ConfigError, ModelConfig
from atom.cuda_graphs import graph_blockers
from atom.engine.model_runner import build_model
from atom.testing import random_prompts, tiny_config
from atom.testing.trained_look import draw_hash_tables
from tests.models.harness import (
    check_against_hf,
    hf_logits,
    load_hf,
    write_checkpoint,
    write_with_random_vectors,
)

ARCHITECTURE = "DeepseekV4ForCausalLM"
TINY = tiny_config(ARCHITECTURE)
TOPK = TINY.index_topk
LONG = 70  # > 4 * TOPK CSA entries, > the window, several HCA windows
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def write_v4(folder, **overrides):
    write_with_random_vectors(tiny_config(ARCHITECTURE, **overrides), folder)
    draw_hash_tables(folder, TINY.n_routed_experts)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v4(tmp_path_factory.mktemp("deepseek_v4"))


def test_logits_match_hf(checkpoint):
    check_against_hf(checkpoint, prompt_lengths=[5, LONG, 23], decode_steps=6)


def test_yarn_compress_rope_matches_hf(tmp_path):
    # The releases scale the "compress" rope (CSA / HCA layers, compressors, indexer) by
    # YaRN with attention_factor 1; the sliding layers' "main" rope stays plain.
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    folder = write_v4(tmp_path, rope_parameters=dict(yarn, beta_fast=32, beta_slow=1))
    check_against_hf(folder, prompt_lengths=[LONG], decode_steps=2)


def test_cached_prefix_matches_hf(checkpoint):
    # 30 tokens first (7 CSA entries and one HCA entry closed, an open window of each),
    # then the rest of the prompt reads them back from the pages.
    check_against_hf(checkpoint, prompt_lengths=[LONG, 9], decode_steps=2, cached_prefix=30)


def test_cached_prefix_in_packed_rows_matches_hf(checkpoint):
    # The caches as vLLM holds them: one row per token packing a page of every tensor, the
    # pages not adjacent; windows close and entries land across steps there too.
    check_against_hf(
        checkpoint, prompt_lengths=[LONG, 9], decode_steps=2, cached_prefix=30, packed_rows=True
    )


def test_the_selection_matters(checkpoint, tmp_path):
    """HF with every entry selected gives other logits on a long prompt: the parity tests
    see the sparse selection."""
    prompt = random_prompts([LONG], seed=5)[0]
    sparse = hf_logits(load_hf(checkpoint), prompt)
    dense = hf_logits(load_hf(write_v4(tmp_path, index_topk=64)), prompt)
    assert (dense[4 * 4 * TOPK :] - sparse[4 * 4 * TOPK :]).abs().max() > 1e-2


def hf_generate(checkpoint, prompts: list[list[int]]) -> list[list[int]]:
    """HF's own generate (its V4 cache: window, compressor buffers, entries)."""
    hf = load_hf(checkpoint)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


def test_engine_chunked_prefill_and_prefix_hit_equal_hf_generate(checkpoint, caplog):
    shared = random_prompts([LONG - 6], seed=9)[0]
    prompts = [shared + [7, 8, 9], random_prompts([3], seed=2)[0], shared + [11, 12]]
    expected = hf_generate(checkpoint, prompts)
    # 16-token chunks over blocks of 4: each long prompt's prefill runs in 5 steps, its
    # windows and entries closing across them; the last prompt hits the shared prefix.
    llm = LLM(
        model=str(checkpoint), dtype="float32", skip_tokenizer_init=True,
        block_size=4, max_num_batched_tokens=16,
    )  # fmt: skip
    first = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    last = llm.generate(prompts[2:], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + last] == expected
    assert last[0].num_cached_tokens == (len(shared) // 4) * 4
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def tokens_through_graph_buffers(folder, prompts, params, device="cpu", **llm_kwargs):
    """(eager tokens, tokens with every decode step run on CUDA graphs' static, padded
    buffers without capturing them: StepGraphs' capture=False), batch sizes 1, 2, 4, 8."""
    outputs = []
    for staged in (False, True):
        llm = LLM(
            str(folder), dtype="float32", device=device, skip_tokenizer_init=True,
            block_size=4, enforce_eager=True, **llm_kwargs,
        )  # fmt: skip
        runner = llm.engine.executor.runner
        if staged:
            runner.capture_cuda_graphs(8, 128, capture=False)
            assert runner.decode_graphs.sizes == [1, 2, 4, 8]
        generated = llm.generate(prompts, params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in generated])
        if staged:  # every decode step went through them (a GPU's async scheduling may add one)
            assert runner.decode_graphs.replays >= max(p.max_tokens for p in params) - 1
    return outputs


def test_decode_through_static_graph_buffers_equals_eager(checkpoint):
    """Five sequences pad to 8, then 3 to 4 as they finish at other lengths, while the
    70-token prompt closes CSA and HCA windows in its decode steps (an HCA entry at
    position 79)."""
    prompts = random_prompts([LONG, 3, 23, 9, 40], seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (14, 5, 9, 3, 11)
    ]
    eager, staged = tokens_through_graph_buffers(checkpoint, prompts, params)
    assert staged == eager


def test_graph_blockers_name_the_torch_route():
    """On the CPU the attention ops are the torch references, which loop over the
    sequences on the host: a host must not capture them."""
    from atom.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(TINY)
    assert "CompressedAttentionImpl" in graph_blockers(model, torch.device("cpu"))


def test_engine_keeps_rows_in_a_window_group_and_entries_in_a_full_one(checkpoint):
    """Window 16 reaches as far as HCA's compressor (16) and CSA's (2 x 4): one window
    group of every layer's rows, one full group of the CSA and HCA layers' entries, each
    in its own pool (tests/models/test_deepseek_v4_kv_pools.py runs them)."""
    llm = LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, block_size=4)
    groups = llm.engine.kv_layout.groups
    assert [(g.sliding_window, g.pool, len(g.layers)) for g in groups] == [
        (None, 0, 2),
        (TINY.sliding_window, 1, TINY.num_hidden_layers),
    ]


def test_the_config_alone_gives_each_layers_cache_shapes():
    """What a host sizes its pool rows from before the model exists (SGLang's) is what
    each built layer's impl then binds, at every page size."""
    from atom.models.deepseek_v4 import DeepseekV4ForCausalLM, cache_layouts

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(TINY)
    impls = [layer.attn.impl for layer in model.model.layers]
    layouts = cache_layouts(TINY)
    assert len(layouts) == len(impls) == TINY.num_hidden_layers
    for layout, impl in zip(layouts, impls):
        assert layout.kv_cache_labels() == impl.kv_cache_labels()
        for block_size in (1, 4, 16, 256):
            assert layout.kv_cache_shapes(3, block_size) == impl.kv_cache_shapes(3, block_size)


@pytest.mark.parametrize(
    "saved, released",
    [
        ("layers.1.attn_hc.base", "layers.1.hc_attn_base"),
        ("layers.0.input_layernorm.weight", "layers.0.attn_norm.weight"),
        ("layers.2.mlp.gate.e_score_correction_bias", "layers.2.ffn.gate.bias"),
        ("layers.0.mlp.shared_experts.up_proj.weight", "layers.0.ffn.shared_experts.w3.weight"),
        ("layers.0.mlp.experts.7.w2.weight", "layers.0.ffn.experts.7.w2.weight"),
        ("layers.1.self_attn.kv_norm.weight", "layers.1.attn.norm.weight"),
        ("layers.1.self_attn.sinks", "layers.1.attn.attn_sink"),
        ("layers.1.self_attn.compressor.position_bias", "layers.1.attn.compressor.ape"),
        (
            "layers.1.self_attn.compressor.indexer.kv_proj.weight",
            "layers.1.attn.indexer.compressor.wkv.weight",
        ),
        (
            "layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
            "layers.1.attn.indexer.weights_proj.weight",
        ),
        ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.compressor.wkv.weight"),
        ("hc_head.hc_fn", "hc_head.hc_fn"),
    ],
)
def test_transformers_5_12_module_names_load_as_the_release_names(saved, released):
    """transformers 5.12 (SGLang 0.5.21's pin) saves V4 under its module names."""
    from atom.models.deepseek_v4 import released_name

    assert released_name(saved) == released


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "compress_rates",
            {"compressed_sparse_attention": 3, "heavily_compressed_attention": 16},
            "config field compress_rates['compressed_sparse_attention']=3 is not supported",
        ),
        ("scoring_func", "relu", "config field scoring_func='relu' is not supported"),
        ("index_topk", 0, "config field index_topk=0 is not supported"),
        (
            "compress_rates",
            {"compressed_sparse_attention": 4, "heavily_compressed_attention": 100},
            "config field compress_rates['heavily_compressed_attention']=100 is not supported",
        ),
    ],
)
def test_variant_atom_lacks_fails_at_load_naming_the_field(tmp_path, field, value, message):
    folder = write_checkpoint(TINY, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as error:
        build_model(ModelConfig.from_pretrained(folder), "cpu", progress=False)
    assert message in str(error.value) and "\n" not in str(error.value)
