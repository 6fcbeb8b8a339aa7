"""DeepSeek-V4's KV cache on the native engine: per-token rows in sliding-window groups,
compressed entries in a full-history group, each in a page pool of its shape
(atom.engine.kv_groups, atom.engine.kv_layout).

The tiny config with a window of 8: the sliding layer's and the CSA layer's rows are read
8 tokens back (CSA's compressor spans 2 x 4), the HCA layer's 16 (its compressor's
window), so the rows form two window groups and the entries one full group, in three
pools. Prompts of 60-75 tokens run past several windows and HCA windows; greedy tokens
equal HF transformers' `generate` through chunked prefill, a prefix-cache hit and
preemption, and a long sequence holds its window's rows and every entry, not every row.
"""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.testing import random_prompts
from tests.models.test_deepseek_v4 import GREEDY, hf_generate, write_v4

WINDOW = 8  # the sliding layer's and CSA's reach; HCA's compressor reaches 16
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_v4(tmp_path_factory.mktemp("deepseek_v4_window8"), sliding_window=WINDOW)


def engine(checkpoint, **kwargs) -> LLM:
    options = dict(block_size=BLOCK, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    return LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, **options | kwargs)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert all(count == 0 for pool in llm.engine.block_manager.pools for count in pool.ref_counts)


def test_rows_and_entries_take_pools_of_their_own_and_the_summary_says_so(checkpoint):
    layout = engine(checkpoint).engine.kv_layout
    # Entries of the CSA and HCA layers; rows of the sliding and CSA layers; HCA's rows.
    assert [(g.sliding_window, g.pool, len(g.layers)) for g in layout.groups] == [
        (None, 0, 2),
        (8, 1, 2),
        (16, 2, 1),
    ]
    # fp32 bytes per page of 4 tokens. Entries: CSA's compressor and indexer entries (one
    # each, 32 wide), HCA's one entry slot. Rows: K = V (32) of two layers, CSA's
    # compressor and indexer rows (2 x 2 x 32 each, overlap); HCA's K = V and rows (2 x 32).
    assert [pool.page_parts for pool in layout.pools] == [
        {"compressor entries": 2 * 128, "indexer entries": 128},
        {"K=V": 2 * 512, "compressor rows": 2048, "indexer rows": 2048},
        {"K=V": 512, "compressor rows": 1024},
    ]
    assert [pool.page_bytes for pool in layout.pools] == [384, 5120, 1536]
    # Every layer keeping every page: K = V of 3 layers, CSA's 2 + 2 rows and 2 entry
    # slots, HCA's rows and entry slot: 440 elements a token.
    assert layout.full_layout_page_bytes == 440 * 4 * BLOCK
    # The split (kv_layout.split_budget): a chunk of 16 adds 7 - 3 pages to the reach-8
    # rows' window and 9 - 5 to HCA's (26624 bytes); the rest buys as many decoding
    # 512-token sequences of each pool: 128 + 3 + 5 pages, 72192 bytes.
    assert layout.prefill_chunk == 16
    rest = (8 << 20) - 4 * 5120 - 4 * 1536
    assert (
        [pool.num_blocks for pool in layout.pools]
        == [
            rest * 128 // 72192,
            rest * 3 // 72192 + 4,
            rest * 5 // 72192 + 4,
        ]
        == [14826, 351, 583]
    )
    # Decoding, a 512-token sequence holds 128 + 3 + 5 pages: 141 bytes a token, against
    # 1760 with every layer keeping every page.
    assert layout.bytes_per_token(512) == (128 * 384 + 3 * 5120 + 5 * 1536) / 512 == 141
    assert layout.report(512)["kv_saving"] == pytest.approx(1760 / 141, abs=1e-3)
    summary = engine(checkpoint).engine.kv_cache_summary()
    assert summary.startswith(
        "KV cache (float32) in 3 pools by page shape, the memory split so that each holds "
        "as many decoding 512-token sequences, the window pools a prefill chunk of 16 "
        "tokens more: pool 0 (2 full-attention layers): 14826 blocks of 4 tokens, 96 B per "
        "token "
        "(64 B compressor entries + 32 B indexer entries); "
        "pool 1 (2 sliding-window(8) layers): 351 blocks of 4 tokens, 1280 B per token "
        "(256 B K=V + 512 B compressor rows + 512 B indexer rows); "
        "pool 2 (1 sliding-window(16) layer): 583 blocks of 4 tokens, 384 B per token "
        "(128 B K=V + 256 B compressor rows): "
    )
    # min(14826 // 128, 351 // 3, 583 // 5) sequences; the same bytes in full-layout pages
    # (8385792 // 7040 = 1191) hold 9.
    assert summary.endswith(
        "115 sequences of 512 tokens fit (128 + 3 + 5 blocks each), 12.48x the tokens of the "
        "full layout in the same memory (9 sequences, 1191 blocks of every layer)"
    )


def test_window_only_kv_false_keeps_every_tensor_on_one_table(checkpoint):
    layout = engine(checkpoint, window_only_kv=False).engine.kv_layout
    assert [(g.sliding_window, len(g.layers)) for g in layout.groups] == [(None, 3)]
    assert [pool.page_bytes for pool in layout.pools] == [layout.full_layout_page_bytes]


def test_chunked_prefill_and_prefix_hit_equal_hf_generate(checkpoint):
    shared = random_prompts([60], seed=21)[0]
    prompts = [shared + [7, 8, 9], random_prompts([45], seed=22)[0], shared + [11, 12]]
    expected = hf_generate(checkpoint, prompts)
    llm = engine(checkpoint)
    first = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    # The hit at 60 tokens: every entry page of the prefix, and the row pages the windows
    # reach from it (freed by the first sequence long ago, still cached).
    last = llm.generate(prompts[2:], GREEDY, use_tqdm=False)
    assert tokens(first + last) == expected
    assert last[0].num_cached_tokens == 60
    assert_all_blocks_free(llm)


def test_preemption_equals_hf_generate(checkpoint):
    prompts = random_prompts([70, 66, 75, 60], seed=23)
    expected = hf_generate(checkpoint, prompts)
    # 80 kB: 48 entry pages, 8 + 11 row pages (one decoding 128-token sequence, 32 + 3 + 5
    # pages, and a chunk's 4 + 4): the four sequences do not fit at once.
    llm = engine(checkpoint, max_model_len=128, kv_cache_memory_bytes=80_000)
    assert [pool.num_blocks for pool in llm.engine.kv_layout.pools] == [48, 8, 11]
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert_all_blocks_free(llm)


def test_a_long_sequence_holds_its_windows_rows_and_every_entry(checkpoint):
    """100 prompt tokens in chunks of 16, then 40 decode steps: after each step the entry
    pool holds a page per 4 computed tokens, each row pool only its window's (and the
    chunk's) pages."""
    llm = engine(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    request = llm.engine.add_request(random_prompts([100], seed=24)[0], params)
    seq = llm.engine.requests[request].seqs[0]
    pools = llm.engine.block_manager.pools
    seen, usage = [], []
    while llm.engine.scheduler.has_work():
        llm.engine.step()
        if seq.block_tables:
            seen.append((seq.num_computed_tokens, [pool.in_use for pool in pools]))
            usage.append(llm.engine.stats().kv_cache_usage)
    assert seen[-1][0] == 138  # the last step frees the sequence
    for computed, (entries, rows_8, rows_16) in seen:
        assert entries == -(-computed // BLOCK)
        chunk = 16 if computed <= 100 else 1
        assert rows_8 <= -(-(WINDOW - 1 + chunk) // BLOCK) + 1
        assert rows_16 <= -(-(16 - 1 + chunk) // BLOCK) + 1
    # Decoding at 138 tokens: 35 entry pages, 3 + 5 row pages, 36480 bytes; every layer
    # keeping every page would hold 35 pages of 7040.
    assert seen[-1][1] == [35, 3, 5]
    layout = llm.engine.kv_layout
    in_use = sum(n * pool.page_bytes for n, pool in zip(seen[-1][1], layout.pools))
    assert in_use == 36480 and 35 * layout.full_layout_page_bytes == 246400
    assert [pool.peak_in_use for pool in pools] == [35, 6, 8]
    # The metric follows the fullest pool: 5 of HCA's 583 row pages before the end.
    assert usage[-1] == 5 / 583
    assert_all_blocks_free(llm)
