"""The attention-metadata schema from a per-request token table, and paged views of a flat pool.

Some hosts (SGLang) do not keep block tables: each request owns a row of a token table
that maps its positions to KV slots (`req_to_token`), and the KV pool of a layer is one
flat `[num_slots, heads, dim]` tensor whose slots are grouped into pages of `page_size`
consecutive, page-aligned slots. Then page p of the pool is slots [p*P, (p+1)*P), a
sequence's block table is the page of every P-th position, and the flat pool viewed as
`[num_slots // P, P, heads, dim]` is exactly the paged cache ATOM's kernels take.
"""

from __future__ import annotations

import torch

from atom.forward_context import AttentionMetadata


def paged_view(flat_cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[num_slots, *rest]` as `[num_slots // page_size, page_size, *rest]` (no copy)."""
    if flat_cache.shape[0] % page_size:
        raise ValueError(
            f"a pool of {flat_cache.shape[0]} slots is not made of pages of {page_size}"
        )
    return flat_cache.view(flat_cache.shape[0] // page_size, page_size, *flat_cache.shape[1:])


def block_table_from_token_table(
    token_table: torch.Tensor,
    rows: torch.Tensor,
    page_size: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[len(rows), ceil(max_seq_len / P)] int32 page ids of each request's positions.

    With `out` (a preallocated [>= len(rows), >= width] int32 buffer, e.g. for CUDA
    graphs) the pages are written into its top-left corner and that view is returned.
    """
    width = -(-max_seq_len // page_size)
    slots = token_table[rows.long(), : width * page_size : page_size]
    pages = (slots // page_size) if page_size > 1 else slots
    if out is None:
        return pages.to(torch.int32)
    view = out[: rows.shape[0], :width]
    view.copy_(pages)
    return view


def metadata_from_token_table(
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    *,
    seq_lens_cpu: torch.Tensor | None = None,
    query_lens_cpu: torch.Tensor | None = None,
    all_decodes: bool = False,
) -> AttentionMetadata:
    """AttentionMetadata for requests `rows` of `token_table`.

    seq_lens [B]: cached + new tokens; query_lens [B]: new tokens; slot_mapping [T]: the
    new tokens' slots. `all_decodes` marks a pure decode step (one query per request);
    otherwise every request is run by the prefill path (which handles any query length,
    so no reordering is needed). Host copies (`*_cpu`) let the torch reference kernels
    loop without device syncs; without them, bounds are read from the device tensors.
    """
    seq_host = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()
    query_host = query_lens_cpu if query_lens_cpu is not None else query_lens.cpu()
    max_seq_len = int(seq_host.max()) if seq_host.numel() else 0
    start_host = torch.zeros(query_host.shape[0] + 1, dtype=torch.int32)
    start_host[1:] = torch.cumsum(query_host, 0)
    start = torch.zeros(start_host.shape, dtype=torch.int32, device=query_lens.device)
    start[1:] = torch.cumsum(query_lens, 0)
    num_seqs = seq_host.shape[0]
    num_decodes = num_seqs if all_decodes else 0
    return AttentionMetadata(
        query_start_loc=start,
        seq_lens=seq_lens.to(torch.int32),
        block_table=block_table_from_token_table(token_table, rows, page_size, max_seq_len),
        slot_mapping=slot_mapping.to(torch.int64),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(query_host.max()) if query_host.numel() else 0,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=start_host,
        seq_lens_cpu=seq_host.to(torch.int32),
    )
