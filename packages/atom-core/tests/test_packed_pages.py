"""atom.hosts.packed_pages: an impl's cache tensors as views of a host's one row per token."""

from __future__ import annotations

import pytest
import torch

from atom.hosts.packed_pages import packed_row_width, unpack_pages


class ThreeTensors:
    """DeepSeek-V4's CSA shapes at block 8, rate 4: K = V rows, compressor rows, entries."""

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [
            (num_blocks, block_size, 5),
            (num_blocks, block_size, 12),
            (num_blocks, block_size // 4, 3),
        ]


def test_row_holds_a_page_of_every_tensor():
    # 8 * 5 + 8 * 12 + 2 * 3 = 142 elements a page -> 18 per token (144 a page).
    assert packed_row_width(ThreeTensors(), 8) == 18


def test_views_split_every_page_in_order_with_the_hosts_page_stride():
    impl, blocks, block = ThreeTensors(), 3, 8
    width = packed_row_width(impl, block)
    # A host layout whose pages are not adjacent (another layer's page between them).
    buffer = torch.zeros(blocks, 2, block, width)
    host = buffer[:, 0]
    views = unpack_pages(host, impl)
    assert [tuple(v.shape) for v in views] == impl.kv_cache_shapes(blocks, block)
    for number, view in enumerate(views, start=1):
        view.fill_(number)
    page = host[1].flatten()
    assert page[:40].eq(1).all() and page[40:136].eq(2).all() and page[136:142].eq(3).all()
    assert page[142:].eq(0).all() and buffer[:, 1].eq(0).all()  # padding, other layer


def test_refuses_rows_that_would_need_a_copy():
    impl = ThreeTensors()
    width = packed_row_width(impl, 8)
    scattered = torch.zeros(3, width, 8).transpose(1, 2)  # a page's rows are not adjacent
    with pytest.raises(RuntimeError):
        unpack_pages(scattered, impl)
    with pytest.raises(ValueError, match="narrower"):
        unpack_pages(torch.zeros(3, 8, width - 1), impl)
