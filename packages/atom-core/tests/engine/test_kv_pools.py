"""Page pools: KV-cache groups whose pages differ in shape draw them from pools of their
own (atom.engine.block_manager, kv_groups, kv_layout). The block manager is driven by
hand here; DeepSeek-V4 runs the engine over them (tests/models/test_deepseek_v4_kv_pools.py).
"""

from __future__ import annotations

import pytest

from atom.engine.block_manager import FREED_PAGE, BlockManager
from atom.engine.kv_groups import KVCacheGroup
from atom.engine.kv_layout import split_budget
from tests.engine.test_sliding_window_kv import decode, live_pages, new_sequence, run_chunk
from tests.models.harness import make_prompts


def two_pools(entry_pages: int = 40, row_pages: int = 6) -> BlockManager:
    """A full group in pool 0 and a window-8 group in pool 1, pages of 4 tokens."""
    return BlockManager([entry_pages, row_pages], 4, windows=[None, 8], pool_of=[0, 1])


def test_each_group_takes_and_gives_back_pages_of_its_own_pool():
    bm = two_pools()
    seq = new_sequence(list(range(16)))
    run_chunk(bm, seq, 16)
    # Page ids count from 0 in each pool.
    assert seq.block_tables == [[0, 1, 2, 3], [0, 1, 2, 3]]
    decode(bm, seq, 60)
    entries, rows = bm.pools
    assert entries.in_use == len(seq.block_tables[0]) == 19  # every page of 76 tokens
    assert rows.in_use == len(live_pages(seq, 1)) <= 3  # ceil(8 / 4) + 1
    # The window's table covers 19 pages from a pool of 6, reusing those it passed: the
    # last step's token (75) saw 68..75, so pages 0-16 are placeholders.
    assert len(seq.block_tables[1]) == 19 > rows.num_blocks
    assert seq.block_tables[1][: seq.num_released_blocks[1]] == [FREED_PAGE] * 17
    assert (entries.peak_in_use, rows.peak_in_use) == (19, 4)
    bm.free_sequence(seq)
    assert bm.num_free_blocks == bm.num_blocks == 46
    assert all(count == 0 for pool in bm.pools for count in pool.ref_counts)


def test_a_full_pool_holds_a_sequence_back_while_the_other_has_room():
    bm = two_pools(row_pages=3)
    seq = new_sequence(list(range(16)))
    # 16 new tokens need 4 pages in each group: the row pool has 3.
    assert bm.blocks_needed(seq, 16) == 8 and bm.num_free_blocks == 43
    assert not bm.can_allocate(seq, 16)
    assert bm.can_allocate(seq, 8)
    run_chunk(bm, seq, 8)
    # Position 8 sees 1..8: the window still holds pages 0-1, and 8 more tokens need 2.
    assert not bm.can_allocate(seq, 8)
    assert bm.pages_held(16, 8) == [4, 4] and bm.pages_held(100, 1) == [25, 3]


def test_prefix_hit_finds_each_groups_pages_in_its_pool():
    bm = two_pools(entry_pages=40, row_pages=8)
    prompt = make_prompts(256, [32], seed=1)[0]
    first = new_sequence(prompt)
    run_chunk(bm, first, 16)
    run_chunk(bm, first, 16)  # the row pool wraps around: its ids differ from the entries'
    assert first.block_tables[0] != first.block_tables[1]
    second = new_sequence(prompt + [5])
    bm.match_prefix(second)
    assert second.num_computed_tokens == 32
    assert second.block_tables[0] == first.block_tables[0]
    assert live_pages(second, 1) == first.block_tables[1][6:8]  # 25..32 of the window
    for seq in (first, second):
        bm.free_sequence(seq)
    assert bm.num_free_blocks == 48


def test_pools_must_each_serve_a_group():
    with pytest.raises(ValueError, match="pool_of=\\[0, 0\\]"):
        BlockManager([8, 8], 4, windows=[None, 8], pool_of=[0, 0])


def test_the_budget_keeps_a_chunk_for_the_windows_and_splits_the_rest_by_sequences():
    groups = [KVCacheGroup(None, (), 0), KVCacheGroup(8, (), 1)]
    # 64-token sequences: 16 full pages and 3 window pages decoding; a 16-token chunk adds
    # 4 window pages. Pages of 100 and 1000 bytes.
    rest = 100_000 - 4 * 1000
    assert split_budget(100_000, groups, [100, 1000], 4, 64, 16) == [
        rest * 16 // 4600,
        rest * 3 // 4600 + 4,
    ]
    # One pool: everything.
    assert split_budget(100_000, groups[:1], [100], 4, 64, 16) == [1000]
