"""vLLM's per-step metadata for the backend tests, built as vLLM's runner builds it."""

from __future__ import annotations

import random

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata


def common_metadata(query_lens, context_lens, block_size, num_blocks, seed=0):
    """A vLLM CommonAttentionMetadata for a mixed step, pages handed out shuffled."""
    rng = random.Random(seed)
    pages = list(range(num_blocks))
    rng.shuffle(pages)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(-(-s // block_size) for s in seq_lens)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots = []
    for i, (c, s) in enumerate(zip(context_lens, seq_lens)):
        row = [pages.pop() for _ in range(-(-s // block_size))]
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, s)]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
