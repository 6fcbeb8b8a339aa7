"""atom.hosts: the token-table bridge to the §3 schema and the TP group adapter."""

from __future__ import annotations

import pytest
import torch

from atom.hosts.group import CoordinatorTensorParallelGroup
from atom.hosts.token_table import (
    block_table_from_token_table,
    metadata_from_token_table,
    paged_view,
)


def token_table(page_size: int) -> torch.Tensor:
    """Row 2: 10 positions on pages 5, 1, 7, ... (page-aligned slots); row 0: 3 tokens on
    page 2 (one page of 4, or slots 2..4 with pages of 1)."""
    table = torch.zeros(4, 16, dtype=torch.int32)
    pages = [5, 1, 7, 9, 12, 11, 6, 8, 10, 13]
    table[2, :10] = torch.tensor(
        [pages[p // page_size] * page_size + p % page_size for p in range(10)]
    )
    table[0, :3] = torch.tensor([2 * page_size + p for p in range(3)])
    return table


def test_paged_view_is_a_view_of_whole_pages():
    flat = torch.arange(24.0).view(12, 2)
    paged = paged_view(flat, 4)
    assert paged.shape == (3, 4, 2) and paged.data_ptr() == flat.data_ptr()
    assert torch.equal(paged[1, 2], flat[6])
    with pytest.raises(ValueError):
        paged_view(flat, 5)


@pytest.mark.parametrize("page_size", [1, 4])
def test_block_table_lists_the_page_of_every_page_start(page_size):
    table = token_table(page_size)
    blocks = block_table_from_token_table(table, torch.tensor([2, 0]), page_size, 10)
    assert blocks.dtype == torch.int32
    if page_size == 4:
        assert blocks.tolist() == [[5, 1, 7], [2, 0, 0]]
    else:
        assert blocks.tolist() == [table[2, :10].tolist(), table[0, :10].tolist()]
    out = torch.full((8, 8), -1, dtype=torch.int32)
    view = block_table_from_token_table(table, torch.tensor([2]), page_size, 8, out=out)
    width = 8 // page_size
    assert view.data_ptr() == out.data_ptr() and view.shape == (1, width)
    assert out[0, :width].tolist() == blocks[0, :width].tolist() and out[1, 0] == -1


def test_metadata_from_token_table():
    table = token_table(4)
    md = metadata_from_token_table(
        table,
        rows=torch.tensor([0, 2]),
        seq_lens=torch.tensor([3, 10]),
        query_lens=torch.tensor([3, 4]),
        slot_mapping=torch.cat([table[0, :3], table[2, 6:10]]),
        page_size=4,
    )
    assert md.host_query_start_loc() == [0, 3, 7] and md.host_seq_lens() == [3, 10]
    assert (md.num_decodes, md.max_query_len, md.max_seq_len, md.num_tokens) == (0, 4, 10, 7)
    assert md.block_table.tolist() == [[2, 0, 0], [5, 1, 7]]
    assert md.slot_mapping.dtype == torch.int64 and md.seq_lens.dtype == torch.int32
    decode = metadata_from_token_table(
        table, torch.tensor([2]), torch.tensor([10]), torch.tensor([1]), table[2, 9:10], 4,
        all_decodes=True,
    )  # fmt: skip
    assert (decode.num_decodes, decode.num_decode_tokens, decode.num_prefills) == (1, 1, 0)


class Coordinator:
    """vLLM's collectives on a 2-rank group, every rank holding x."""

    rank_in_group, world_size = 1, 2

    def all_reduce(self, x):
        return x * 2

    def all_gather(self, x, dim):
        return torch.cat([x, x], dim)

    def reduce_scatter(self, x, dim):
        return (x * 2).chunk(2, dim)[self.rank_in_group]


class SGLangCoordinator(Coordinator):
    """SGLang's reduce_scatter fills a given output from a list; the out-of-place one is
    reduce_scatter_along_dim."""

    def reduce_scatter(self, output, input_list):
        raise AssertionError("the in-place list form")

    reduce_scatter_along_dim = Coordinator.reduce_scatter


@pytest.mark.parametrize("coordinator", [Coordinator, SGLangCoordinator])
def test_coordinator_group_adapter(coordinator):
    group = CoordinatorTensorParallelGroup(coordinator())
    assert (group.rank, group.world_size) == (1, 2)
    assert group.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
    assert group.all_gather(torch.ones(1, 2), dim=0).shape == (2, 2)
    assert group.reduce_scatter(torch.arange(4.0).view(4, 1)).tolist() == [[4.0], [6.0]]


def test_state_slots_from_host_rows_and_computed_tokens():
    """A host's per-request state rows and computed tokens as the schema's state fields:
    a decode and a later chunk continue their state, a first chunk starts from zeros."""
    from atom.forward_context import AttentionMetadata
    from atom.hosts.state import with_state_slots

    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 6, 10], dtype=torch.int32),
        seq_lens=torch.tensor([8, 5, 12], dtype=torch.int32),
        block_table=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.arange(10),
        num_decodes=1,
        num_decode_tokens=1,
        max_query_len=5,
        max_seq_len=12,
    )
    rows = torch.tensor([7, 2, 11, 0], dtype=torch.int64)  # a host's padded row list
    out = with_state_slots(metadata, rows, torch.tensor([7, 0, 8, 0]))
    assert out.state_slots.dtype == torch.int32 and out.state_slots.tolist() == [7, 2, 11]
    assert out.has_initial_state.tolist() == [True, False, True]
    assert metadata.state_slots is None  # a copy: the attention layers' metadata is unchanged
    with pytest.raises(ValueError, match="state_slots has 2 rows .* 3 requests"):
        with_state_slots(metadata, rows[:2], torch.zeros(3))
