"""The native engine: batching, prefix caching, preemption and chunked prefill keep greedy
tokens identical to HF transformers and to each other."""

from __future__ import annotations

import math

import pytest

from atom import LLM, SamplingParams
from atom.testing import references
from tests.models.harness import make_prompts, write_checkpoint
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
    return references.hf_greedy(checkpoint, prompts, GREEDY.max_tokens)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine(checkpoint, **kwargs) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, **kwargs)


def assert_equal_up_to_float_rounding(actual, expected, path: str = "") -> None:
    """Equal structure, tokens and reasons; floats equal to 1e-5 relative. Steps that
    batch sequences differently run GEMMs of another M, which a CPU may sum in another
    order (AMX does), so log-probabilities may differ in their last bits."""
    if isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=1e-5, abs_tol=1e-6), (path, actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), path
        for key in expected:
            assert_equal_up_to_float_rounding(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), (path, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal_up_to_float_rounding(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, (path, actual, expected)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == stats.num_waiting == 0


ASYNC = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])


@ASYNC
def test_batch_equals_hf_and_single_requests(checkpoint, prompts, hf_greedy, overlap):
    llm = engine(checkpoint, async_scheduling=overlap)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    singles = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:3]]
    assert singles == hf_greedy[:3]
    reversed_batch = tokens(llm.generate(prompts[::-1], GREEDY, use_tqdm=False))
    assert reversed_batch == hf_greedy[::-1]
    assert_all_blocks_free(llm)


@ASYNC
def test_prefix_cache_reuses_blocks(checkpoint, hf_greedy, overlap):
    shared = make_prompts(256, [40], seed=11)[0]
    first, second = shared + [1, 2, 3], shared + [9, 8]
    llm = engine(checkpoint, block_size=8, async_scheduling=overlap)
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


@ASYNC
def test_preemption_keeps_tokens_and_frees_blocks(checkpoint, prompts, hf_greedy, overlap):
    # 12 blocks of 8 tokens: the longest sequence alone needs 8, so the six prompts
    # cannot all be resident and the scheduler must preempt and recompute.
    llm = engine(checkpoint, block_size=8, num_blocks=12, async_scheduling=overlap)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outputs) == hf_greedy
    assert llm.engine.stats().num_preemptions > 0
    assert_all_blocks_free(llm)
    for m in (output.metrics for output in outputs):  # the stages stamped in order
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time


@ASYNC
@pytest.mark.parametrize("budget", [3, 16])
def test_chunked_prefill(checkpoint, prompts, hf_greedy, budget, overlap):
    llm = engine(checkpoint, max_num_batched_tokens=budget, async_scheduling=overlap)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    assert_all_blocks_free(llm)


def test_sequence_too_long_for_cache_is_rejected(checkpoint):
    llm = engine(checkpoint, block_size=8, num_blocks=2)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=20), use_tqdm=False)
    assert llm.generate([[1] * 4], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs


@ASYNC
def test_tensor_parallel_engine_matches_single_process(checkpoint, prompts, hf_greedy, overlap):
    """With async scheduling, the other rank reads the tokens rank 0 sampled on the device."""
    llm = engine(checkpoint, tensor_parallel_size=2, async_scheduling=overlap)
    try:
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    finally:
        llm.engine.shutdown()


def test_async_scheduling_equals_sync_for_every_feature(checkpoint, prompts):
    """Stops at different steps (length, stop tokens, EOS after min_tokens), n > 1 with a
    seed, logprobs and prompt logprobs, and penalties (which step synchronously), with
    more sequences than max_num_seqs so admissions happen while steps are in flight."""
    eos = 7
    params = [
        SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(4)
    ] + [
        SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[5, 17, 33]),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=4),
        SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=3, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5, ignore_eos=True),
    ]
    batch = (prompts + prompts)[: len(params)]
    runs = {}
    for overlap in (False, True):
        llm = engine(checkpoint, max_num_seqs=4, async_scheduling=overlap)
        llm.engine.eos_token_ids = {eos}
        runs[overlap] = [
            [
                (c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
                for c in o.outputs
            ]
            + [o.prompt_logprobs]
            for o in llm.generate(batch, params, use_tqdm=False)
        ]
        assert_all_blocks_free(llm)
    assert_equal_up_to_float_rounding(runs[True], runs[False])


def test_abort_while_a_step_is_in_flight(checkpoint, prompts):
    llm = engine(checkpoint, async_scheduling=True)
    core = llm.engine
    ids = [core.add_request(p, GREEDY) for p in prompts]
    for _ in range(4):
        core.step()
    assert core._in_flight is not None
    core.abort_request(ids[2])
    finished = {}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert set(finished) == set(ids) - {ids[2]}
    expected = tokens(engine(checkpoint).generate(prompts, GREEDY, use_tqdm=False))
    assert [finished[i] for i in ids if i != ids[2]] == expected[:2] + expected[3:]
    assert all(t >= 0 for out in finished.values() for t in out)
    assert_all_blocks_free(llm)
