"""The vectorised step builder describes a batch exactly as AttentionMetadata.build does
from per-sequence lists."""

from __future__ import annotations

import random

import numpy as np
import torch

from atom.engine.step_arrays import StepInput, build_step_arrays, pad_rows_in_front, upload
from atom.forward_context import AttentionMetadata
from atom.kernels.few_queries import MAX_DECODE_QUERIES

BLOCK = 4


def random_batch(rng: random.Random, num_decodes: int, num_prefills: int) -> list[StepInput]:
    batch = []
    for query_len in [1] * num_decodes + [rng.randint(2, 9) for _ in range(num_prefills)]:
        start = rng.randint(0, 20)
        pages = rng.sample(range(100), -(-(start + query_len) // BLOCK) + rng.randint(0, 1))
        batch.append(StepInput([rng.randrange(50) for _ in range(query_len)], start, [pages]))
    return batch


def reference(batch: list[StepInput]) -> AttentionMetadata:
    slots = [
        item.block_tables[0][p // BLOCK] * BLOCK + p % BLOCK
        for item in batch
        for p in range(item.start_position, item.start_position + len(item.token_ids))
    ]
    return AttentionMetadata.build(
        query_lens=[len(item.token_ids) for item in batch],
        seq_lens=[item.start_position + len(item.token_ids) for item in batch],
        block_tables=[item.block_tables[0] for item in batch],
        slot_mapping=slots,
    )


def test_step_arrays_match_per_sequence_build():
    rng = random.Random(0)
    for num_decodes, num_prefills in [(0, 1), (1, 0), (5, 0), (3, 4), (0, 6), (17, 2)]:
        batch = random_batch(rng, num_decodes, num_prefills)
        ids, positions, metadata = upload(build_step_arrays(batch, BLOCK), torch.device("cpu"))
        expected = reference(batch)
        assert ids.tolist() == [t for item in batch for t in item.token_ids]
        assert positions.tolist() == [
            p for x in batch for p in range(x.start_position, x.start_position + len(x.token_ids))
        ]
        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            assert torch.equal(getattr(metadata, field), getattr(expected, field)), field
        for field in ("num_decodes", "num_decode_tokens", "max_query_len", "max_seq_len"):
            assert getattr(metadata, field) == getattr(expected, field), field


def test_short_block_table_is_an_error():
    try:
        build_step_arrays([StepInput([1, 2, 3], 2, [[7]])], BLOCK)
    except ValueError as exc:
        assert "cannot hold 5 tokens" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
    assert np.array_equal(build_step_arrays([StepInput([1], 3, [[7]])], BLOCK).slot_mapping, [[31]])


def test_staged_buffers_views_and_partial_upload():
    from atom.engine.staged_buffers import StagedBuffers

    buffers = StagedBuffers(
        {"ids": (torch.int64, (5,)), "lens": (torch.int32, (5,)), "table": (torch.int32, (5, 3))},
        "cpu",
    )
    host = buffers.host()
    host["ids"][:] = [1, 2, 3, 4, 5]
    host["lens"][:] = 7
    host["table"][:] = np.arange(15).reshape(5, 3)
    buffers.upload(buffers.end_of("table", 2))
    device = buffers.device
    assert device["ids"].tolist() == [1, 2, 3, 4, 5] and device["lens"].tolist() == [7] * 5
    assert device["table"].tolist() == [[0, 1, 2], [3, 4, 5]] + [[0, 0, 0]] * 3


def test_padding_rows_in_front_sit_at_earlier_positions_and_write_nowhere():
    """A ragged batch padded to 4 rows a sequence is the batch whose sequences start that
    many rows earlier with padding tokens, except that the padding rows write no slot."""
    batch = [
        StepInput([11], 9, [[5, 6, 7]]),
        StepInput([21, 22, 23, 24], 3, [[8, 9]]),
        StepInput([31, 32], 6, [[1, 2]]),
    ]
    padded, token_rows = pad_rows_in_front(build_step_arrays(batch, BLOCK), 4)
    front = [StepInput([0] * (4 - len(x.token_ids)) + x.token_ids, x.start_position
                       - (4 - len(x.token_ids)), x.block_tables) for x in batch]  # fmt: skip
    expected = build_step_arrays(front, BLOCK)
    assert token_rows.tolist() == [3, 4, 5, 6, 7, 10, 11]
    for field in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table"):
        assert np.array_equal(getattr(padded, field), getattr(expected, field)), field
    kept = np.zeros(12, bool)
    kept[token_rows] = True
    assert np.array_equal(padded.slot_mapping[:, kept], expected.slot_mapping[:, kept])
    assert (padded.slot_mapping[:, ~kept] == -1).all()
    assert padded.num_decodes == 0


def test_padding_rows_in_front_needs_room():
    arrays = build_step_arrays([StepInput([1, 2], 1, [[3]]), StepInput([4], 0, [[5]])], BLOCK)
    assert pad_rows_in_front(arrays, 1) is None  # a sequence has more rows
    assert pad_rows_in_front(arrays, 2) is None  # no context to put a row in front of
    long = build_step_arrays([StepInput([1], 40, [[3] * 11])], BLOCK)
    assert pad_rows_in_front(long, MAX_DECODE_QUERIES) is not None
    # More rows would take the prefill kernels, which read the padding's dense K/V.
    assert pad_rows_in_front(long, MAX_DECODE_QUERIES + 1) is None
