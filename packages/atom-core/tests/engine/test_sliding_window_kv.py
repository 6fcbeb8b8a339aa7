"""Window-only KV pages: sliding-window layers keep only the pages their window reaches.

Block-manager tests drive the grouped pool by hand; engine tests run a tiny GPT-OSS
(a sliding layer of window 16 and a full layer) past several windows and compare with
HF transformers and with the engine that keeps every page (window_only_kv=False).
"""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.block_manager import FREED_PAGE, BlockManager
from atom.engine.kv_groups import pages_held
from atom.engine.sequence import Sequence
from atom.forward_context import AttentionMetadata
from tests.models.harness import load_hf, make_prompts, write_with_random_vectors
from tests.models.test_gpt_oss import gpt_oss_config

WINDOW = 16


def new_sequence(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=64))


def run_chunk(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the scheduler and the engine do for a step of n new tokens."""
    assert bm.can_allocate(seq, n)
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def decode(bm: BlockManager, seq: Sequence, steps: int, first_token: int = 1000) -> None:
    for i in range(steps):
        seq.token_ids.append(first_token + i)
        run_chunk(bm, seq, 1)


def live_pages(seq: Sequence, group: int) -> list[int]:
    return seq.block_tables[group][seq.num_released_blocks[group] :]


# Block manager ------------------------------------------------------------------------


def test_window_group_frees_the_pages_its_window_passed():
    bm = BlockManager(64, 4, windows=[None, WINDOW])
    seq = new_sequence(list(range(40)))
    assert bm.blocks_needed(seq, 40) == 20  # the chunk needs every page in both groups
    run_chunk(bm, seq, 40)
    assert bm.num_free_blocks == 64 - 20
    # Next token at position 40 sees keys 25..40: pages 0-5 (tokens 0-23) are passed.
    assert bm.blocks_needed(seq, 1) == 2 - 6
    decode(bm, seq, 1)
    assert seq.num_released_blocks == [0, 6]
    assert seq.block_tables[1][:6] == [FREED_PAGE] * 6
    assert len(seq.block_tables[0]) == len(seq.block_tables[1]) == 11
    assert bm.num_free_blocks == 64 - 11 - 5
    # Far past several windows, the window group holds at most ceil(16 / 4) + 1 pages.
    for _ in range(60):
        decode(bm, seq, 1)
        assert len(live_pages(seq, 1)) <= WINDOW // 4 + 1
        assert len(live_pages(seq, 0)) == -(-seq.num_computed_tokens // 4)
    bm.free_sequence(seq)
    assert bm.num_free_blocks == 64
    assert all(count == 0 for count in bm.pools[0].ref_counts)


def test_pages_shared_with_another_sequence_do_not_count_as_given_back():
    bm = BlockManager(64, 4, windows=[None, 8])
    first = new_sequence(list(range(33)))
    run_chunk(bm, first, 33)
    second = new_sequence(list(range(33)))
    bm.match_prefix(second)  # shares 8 full-group pages and window pages 6 and 7
    assert second.num_computed_tokens == 32
    assert live_pages(second, 1) == first.block_tables[1][6:8]
    run_chunk(bm, second, 1)
    for step in range(12):  # `first`'s window passes pages 6 and 7, which `second` keeps
        first.token_ids.append(step)
        free_before, needed = bm.num_free_blocks, bm.blocks_needed(first, 1)
        run_chunk(bm, first, 1)
        assert bm.num_free_blocks == free_before - needed
    assert first.num_released_blocks[1] == 9  # (44 - 7) // 4
    assert all(
        bm.pools[0].ref_counts[p] == 1 and p not in bm.pools[0].free for p in live_pages(second, 1)
    )
    for seq in (first, second):
        bm.free_sequence(seq)
    assert bm.num_free_blocks == 64


def test_prefix_hit_needs_only_the_windows_pages():
    bm = BlockManager(64, 4, windows=[None, 8])
    prompt = make_prompts(256, [32], seed=1)[0]
    first = new_sequence(prompt)
    run_chunk(bm, first, 32)
    decode(bm, first, 8)  # the window moves on: its pages 0-7 are released, still cached
    assert first.num_released_blocks[1] == 8
    second = new_sequence(prompt + [5, 6])
    bm.match_prefix(second)
    # A hit at 32 tokens: the full group needs pages 0-7, the window (next token 32 sees
    # 25..32) pages 6 and 7 only; the earlier ones are placeholders.
    assert second.num_computed_tokens == 32
    assert second.num_released_blocks == [0, 6]
    assert second.block_tables[0] == first.block_tables[0][:8]
    assert second.block_tables[1][:6] == [FREED_PAGE] * 6
    bm.free_sequence(second)
    bm.free_sequence(first)
    assert bm.num_free_blocks == 64


def test_prefix_hit_stops_where_the_window_lost_its_pages():
    # One window group: its freed pages are reused least recently freed first.
    bm = BlockManager(16, 4, windows=[8])
    prompt = make_prompts(256, [32], seed=2)[0]
    first = new_sequence(prompt)
    run_chunk(bm, first, 32)
    bm.free_sequence(first)  # pages of blocks 7..0 freed in that order: block 7 first
    evicted = []
    while len(evicted) < 9:  # the 8 never-used pages, then the page of block 7
        filler = new_sequence([200 + len(evicted)] * 4)
        run_chunk(bm, filler, 4)
        evicted.append(filler)
    second = new_sequence(prompt + [9])
    bm.match_prefix(second)
    # Block 7 is gone; a hit at 28 tokens needs blocks 5 and 6 (next token 28 sees 21..28).
    assert second.num_computed_tokens == 28
    assert second.num_released_blocks == [5]
    for seq in [second, *evicted]:
        bm.free_sequence(seq)
    assert bm.num_free_blocks == 16


def test_full_group_bounds_the_hit():
    bm = BlockManager(64, 4, windows=[None, 8])
    prompt = make_prompts(256, [24], seed=3)[0]
    first = new_sequence(prompt)
    run_chunk(bm, first, 24)
    other = new_sequence(prompt[:8] + [1] * 16)
    bm.match_prefix(other)
    assert other.num_computed_tokens == 8  # the full group shares only two pages
    bm.free_sequence(other)
    bm.free_sequence(first)
    assert bm.num_free_blocks == 64


def test_a_sequence_left_waiting_pins_no_pages_and_counts_once():
    bm = BlockManager(64, 4, windows=[None, 8])
    prompt = make_prompts(256, [24], seed=4)[0]
    run_chunk(bm, new_sequence(prompt), 24)  # cached, still held
    free_before = bm.num_free_blocks
    waiting = new_sequence(prompt + [1])
    bm.match_prefix(waiting)
    assert waiting.num_computed_tokens == 24 and bm.prefix_hits == 24
    bm.cancel_match(waiting)  # the scheduler could not admit it
    assert bm.num_free_blocks == free_before and waiting.block_tables == []
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    bm.match_prefix(waiting)
    assert (bm.prefix_queries, bm.prefix_hits) == (25, 24)


def test_pages_held_bounds_each_group():
    assert pages_held([None], 4, 100) == 25
    assert pages_held([None, 16], 4, 100) == 25 + 5
    assert pages_held([None, 16], 4, 100, chunk=100) == 50
    assert pages_held([None, 16], 4, 100, chunk=8) == 25 + 7
    assert pages_held([16], 4, 10) == 3


def test_bad_windows_are_rejected():
    with pytest.raises(ValueError, match="windows=\\[None, 0\\]"):
        BlockManager(8, 4, windows=[None, 0])


# Engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_with_random_vectors(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


PROMPT_LENGTHS = [40, 73, 100, 57]
MAX_TOKENS = 40


def engine(checkpoint, **kwargs) -> LLM:
    return LLM(
        model=str(checkpoint),
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=8 << 20,
        **kwargs,
    )


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs
    )


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(-1)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_and_logprobs_equal_hf(checkpoint, hf, block_size):
    prompts = make_prompts(256, PROMPT_LENGTHS, seed=5)
    llm = engine(checkpoint, block_size=block_size)
    assert len(llm.engine.kv_layout.groups) == 2
    outputs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        tokens = prompt + completion.token_ids
        expected = hf_logprobs(hf, tokens)
        for i, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = expected[len(prompt) + i - 1]
            assert token == int(row.argmax())  # HF's greedy choice, step by step
            for candidate, logprob in entries.items():
                assert abs(logprob - row[candidate].item()) < 1e-4
    assert llm.engine.block_manager.peak_blocks_in_use > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [7, 24])
def test_chunked_prefill_across_the_window_equals_keeping_every_page(checkpoint, budget):
    prompts = make_prompts(256, PROMPT_LENGTHS, seed=6)
    windowed = engine(checkpoint, block_size=4, max_num_batched_tokens=budget)
    full = engine(checkpoint, block_size=4, max_num_batched_tokens=budget, window_only_kv=False)
    assert len(full.engine.kv_layout.groups) == 1
    got = [o.outputs[0].token_ids for o in windowed.generate(prompts, greedy(), use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in full.generate(prompts, greedy(), use_tqdm=False)]
    assert got == want
    assert_all_blocks_free(windowed)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_prefix_cache_hits_equal_a_cold_run(checkpoint, overlap):
    shared = make_prompts(256, [52], seed=9)[0]
    prompts = [shared + [3, 1, 4], shared + [1, 5], shared[:30] + [9] * 20]
    llm = engine(checkpoint, block_size=8, async_scheduling=overlap)
    outputs = [llm.generate([p], greedy(), use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outputs] == [0, 48, 24]
    cold = engine(checkpoint, block_size=8, enable_prefix_caching=False)
    expected = cold.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert_all_blocks_free(llm)


def test_preemption_and_abort_free_every_group(checkpoint):
    prompts = make_prompts(256, PROMPT_LENGTHS, seed=4)
    reference = engine(checkpoint, block_size=4, window_only_kv=False)
    expected = [
        o.outputs[0].token_ids for o in reference.generate(prompts, greedy(), use_tqdm=False)
    ]
    # 60 pages: the longest sequence alone may hold 35 + 9, so the four preempt.
    tight = engine(checkpoint, block_size=4, num_blocks=60, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy(), use_tqdm=False)]
    assert got == expected
    assert tight.engine.stats().num_preemptions > 0
    assert_all_blocks_free(tight)
    request = tight.engine.add_request(prompts[2], greedy())
    for _ in range(30):  # into the decode, with window pages released
        tight.engine.step()
    seq = tight.engine.requests[request].seqs[0]
    assert seq.num_released_blocks[1] > 0
    tight.engine.abort_request(request)
    assert_all_blocks_free(tight)


def test_window_layout_peak_pages_are_the_expected_saving(checkpoint):
    """One sequence, 60 prompt tokens in chunks of 8, 40 new tokens, 4-token pages."""
    prompt = make_prompts(256, [60], seed=12)[0]
    peaks, page_bytes = {}, {}
    for window_only in (True, False):
        llm = engine(checkpoint, block_size=4, max_num_batched_tokens=8, window_only_kv=window_only)
        llm.generate([prompt], greedy(), use_tqdm=False)
        peaks[window_only] = llm.engine.block_manager.peak_blocks_in_use
        page_bytes[window_only] = llm.engine.kv_layout.pools[0].page_bytes
    # The schedule by hand: chunks [c, c + n); the full group holds ceil((c + n) / 4)
    # pages, the window group those from page (c - 15) // 4 on.
    steps = [(c, min(8, 60 - c)) for c in range(0, 60, 8)] + [(c, 1) for c in range(60, 99)]
    expected = max(2 * -(-(c + n) // 4) - max(0, c - WINDOW + 1) // 4 for c, n in steps)
    assert peaks[True] == expected == 25 + 5  # full group + ceil(16 / 4) + 1
    assert peaks[False] == 25  # 99 computed tokens
    # A window-layout page holds one layer (the two groups share it), a full one both:
    # the window layout peaks at 30 one-layer pages, the full one at 25 two-layer pages.
    assert page_bytes[False] == 2 * page_bytes[True]
    assert peaks[True] * page_bytes[True] == 15 * page_bytes[False]


def test_startup_summary_reports_both_groups(checkpoint):
    llm = engine(checkpoint, block_size=16, max_model_len=512)
    summary = llm.engine.kv_cache_summary()
    assert "shared by 2 groups (1 full-attention layer, 1 sliding-window(16) layer)" in summary
    assert "the full layout" in summary
    report = llm.engine.kv_layout.report(512)
    assert report["kv_bytes_per_token_full_layout"] / report["kv_bytes_per_token"] == (
        pytest.approx(report["kv_saving"], rel=1e-3)
    )
    # 512 tokens: 32 full pages + 2 window pages of one layer vs 32 pages of two layers.
    assert report["kv_saving"] == pytest.approx(64 / 34, rel=1e-3)


def test_decode_graph_inputs_carry_every_groups_tables(checkpoint):
    """The CUDA-graph input path (static buffers per group), replayed eagerly on the CPU."""
    prompts = make_prompts(256, PROMPT_LENGTHS[:3], seed=13)
    outputs = {}
    for staged in (False, True):
        llm = engine(checkpoint, block_size=4)
        runner = llm.engine.executor.runner
        if staged:
            runner.capture_cuda_graphs(4, 256, capture=False)
            assert runner.decode_graphs.num_kv_groups == 2
        outputs[staged] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)
        ]
        if staged:
            assert runner.decode_graphs.replays >= MAX_TOKENS - 1
    assert outputs[True] == outputs[False]


def test_a_layer_of_a_missing_group_is_an_error():
    metadata = AttentionMetadata.build([2], [2], [[3]], [12, 13])
    assert metadata.for_kv_group(0) is metadata
    with pytest.raises(ValueError, match="kv_group=1: the step's metadata has tables for 1"):
        metadata.for_kv_group(1)
