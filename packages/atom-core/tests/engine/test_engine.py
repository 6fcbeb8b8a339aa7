"""The native engine: batching, prefix caching, preemption and chunked prefill keep greedy
tokens identical to HF transformers and to each other."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from tests.models.harness import load_hf, make_prompts, write_checkpoint
from tests.models.test_llama import qwen3_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(qwen3_config(), tmp_path_factory.mktemp("qwen3"), init_std=0.1)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(256, [5, 31, 12, 47, 2, 20], seed=3)


@pytest.fixture(scope="module")
def hf_greedy(checkpoint, prompts):
    hf = load_hf(checkpoint)
    outputs = []
    for prompt in prompts:
        with torch.inference_mode():
            ids = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine(checkpoint, **kwargs) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_batch_equals_hf_and_single_requests(checkpoint, prompts, hf_greedy):
    llm = engine(checkpoint)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    singles = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:3]]
    assert singles == hf_greedy[:3]
    reversed_batch = tokens(llm.generate(prompts[::-1], GREEDY, use_tqdm=False))
    assert reversed_batch == hf_greedy[::-1]
    assert_all_blocks_free(llm)


def test_prefix_cache_reuses_blocks(checkpoint, hf_greedy):
    shared = make_prompts(256, [40], seed=11)[0]
    first, second = shared + [1, 2, 3], shared + [9, 8]
    llm = engine(checkpoint, block_size=8)
    out_first = llm.generate([first], GREEDY, use_tqdm=False)[0]
    assert out_first.num_cached_tokens == 0
    hits_before = llm.engine.stats().prefix_cache_hits
    out_second = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out_second.num_cached_tokens == 40  # five full 8-token blocks of the shared prefix
    assert llm.engine.stats().prefix_cache_hits - hits_before == 40
    uncached = engine(checkpoint, block_size=8, enable_prefix_caching=False)
    assert tokens(uncached.generate([first, second], GREEDY, use_tqdm=False)) == [
        out_first.outputs[0].token_ids,
        out_second.outputs[0].token_ids,
    ]
    assert_all_blocks_free(llm)


def test_preemption_keeps_tokens_and_frees_blocks(checkpoint, prompts, hf_greedy):
    # 12 blocks of 8 tokens: the longest sequence alone needs 8, so the six prompts
    # cannot all be resident and the scheduler must preempt and recompute.
    llm = engine(checkpoint, block_size=8, num_blocks=12)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    assert llm.engine.stats().num_preemptions > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [3, 16])
def test_chunked_prefill(checkpoint, prompts, hf_greedy, budget):
    llm = engine(checkpoint, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    assert_all_blocks_free(llm)


def test_sequence_too_long_for_cache_is_rejected(checkpoint):
    llm = engine(checkpoint, block_size=8, num_blocks=2)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=20), use_tqdm=False)
    assert llm.generate([[1] * 4], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs


def test_tensor_parallel_engine_matches_single_process(checkpoint, prompts, hf_greedy):
    llm = engine(checkpoint, tensor_parallel_size=2)
    try:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    finally:
        llm.engine.shutdown()
