"""One metadata object reused over static buffers (a decode graph's warm-up, capture and
replays; SGLang's per-size graph metadata): what a forward derives from its tensors is
derived again by the next forward, so a captured graph records those ops rather than
holding the warm-up batch's values."""

from __future__ import annotations

import torch

from atom.forward_context import AttentionMetadata, set_forward_context


def test_token_bounds_follow_refilled_buffers_once_per_forward():
    metadata = AttentionMetadata.build([1, 1], [5, 9], [[0, 1], [2, 3]], [4, 8])
    metadata.kv_group_tables = ((metadata.block_table, metadata.slot_mapping),) * 2
    with set_forward_context(metadata):
        assert metadata.query_token_bounds[1].tolist() == [5, 9]
        assert metadata.for_kv_group(1).query_token_bounds[1].tolist() == [5, 9]
    metadata.seq_lens.copy_(torch.tensor([6, 10], dtype=torch.int32))  # the next step's refill
    with set_forward_context(metadata):
        bounds = metadata.query_token_bounds
        assert bounds[1].tolist() == [6, 10] and bounds[0].tolist() == [0, 1]
        assert metadata.query_token_bounds is bounds  # every layer of the forward shares it
        assert metadata.for_kv_group(1).query_token_bounds[1].tolist() == [6, 10]
