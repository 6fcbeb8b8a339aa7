"""A step's inputs as numpy arrays, built in a few vectorised passes over the batch.

Per-sequence torch tensors cost microseconds each; at a thousand sequences a step would
spend milliseconds before the GPU sees it. Here the batch is flattened once into numpy
arrays, which then reach the device in one copy (`upload`), or are written into the
pinned buffers of the CUDA-graph inputs (`cuda_graphs.DecodeGraphs`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.few_queries import MAX_DECODE_QUERIES


@dataclass
class StepInput:
    """One sequence's part of a step: its new tokens, where they start, and its pages."""

    token_ids: list[int]
    start_position: int  # tokens already in the cache
    block_tables: list[list[int]]  # one per KV-cache group (kv_groups.py), of equal length
    state_slot: int | None = None  # its row in a hybrid model's state pools


# Stands in a step's input tokens for one a TokenFeed supplies on the device.
FED_TOKEN = 0


def to_device(values: list[int], device: torch.device, dtype=torch.long) -> torch.Tensor:
    """A host list as a device tensor, without waiting: torch.tensor(..., device=cuda)
    copies blocking, so the host would wait for the GPU's queued work (the drafter's
    steps, say) before it could launch the next."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass
class TokenFeed:
    """Input tokens that are still on the device (sampled by the step before, not yet
    seen by the host): token row rows[i] of this step takes tokens[sources[i]]."""

    tokens: torch.Tensor
    rows: list[int]
    sources: list[int]

    def apply(self, input_ids: torch.Tensor) -> None:
        index = torch.tensor([self.rows, self.sources]).to(input_ids.device, non_blocking=True)
        input_ids[index[0]] = self.tokens[index[1]]

    def padded(self, token_rows: np.ndarray) -> TokenFeed:
        """The feed of the batch `pad_rows_in_front` made, whose token i is row token_rows[i]."""
        return TokenFeed(self.tokens, token_rows[self.rows].tolist(), self.sources)


@dataclass
class StepArrays:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [G, T] int64, one row per KV-cache group
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_table: np.ndarray  # [B, G, width] int32, zero-padded
    num_decodes: int  # leading rows with one new token
    state_slots: np.ndarray | None = None  # [B] int32, hybrid models only
    has_initial_state: np.ndarray | None = None  # [B] bool: the sequence has cached tokens

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_step_arrays(batch: list[StepInput], block_size: int) -> StepArrays:
    """Flattens a batch; the block tables are as wide as the longest."""
    num_seqs = len(batch)
    num_groups = len(batch[0].block_tables) if batch else 1
    query_lens = np.fromiter((len(x.token_ids) for x in batch), np.int64, num_seqs)
    starts = np.fromiter((x.start_position for x in batch), np.int64, num_seqs)
    num_pages = np.fromiter((len(x.block_tables[0]) for x in batch), np.int64, num_seqs)
    seq_lens = starts + query_lens
    short = np.nonzero(-(-seq_lens // block_size) > num_pages)[0]
    if len(short):
        i = short[0]
        raise ValueError(f"block table of {num_pages[i]} pages cannot hold {seq_lens[i]} tokens")
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    table = np.zeros((num_seqs, num_groups, max(int(num_pages.max(initial=0)), 1)), np.int32)
    page_starts = np.cumsum(num_pages) - num_pages
    rows = np.repeat(np.arange(num_seqs), num_pages)
    columns = np.arange(int(num_pages.sum())) - np.repeat(page_starts, num_pages)
    for group in range(num_groups):
        flat = np.fromiter(chain.from_iterable(x.block_tables[group] for x in batch), np.int32)
        if len(flat) != len(columns):
            raise ValueError(
                f"block tables of KV-cache group {group} hold {len(flat)} pages, those of "
                f"group 0 {len(columns)}: every group's table covers the same positions"
            )
        table[rows, group, columns] = flat
    # Token t of sequence s sits at position starts[s] + (t - query_start_loc[s]).
    token_rows = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens) + np.repeat(starts - query_start_loc[:-1], query_lens)
    pages = table[token_rows, :, positions // block_size].T.astype(np.int64)  # [G, T]
    ones = np.flatnonzero(query_lens != 1)
    state_slots = has_initial_state = None
    if num_seqs and batch[0].state_slot is not None:
        state_slots = np.fromiter((x.state_slot for x in batch), np.int32, num_seqs)
        has_initial_state = starts > 0  # no prefix cache for these: cached means computed here
    return StepArrays(
        input_ids=np.fromiter(chain.from_iterable(x.token_ids for x in batch), np.int64),
        positions=positions,
        slot_mapping=pages * block_size + positions % block_size,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=table,
        num_decodes=int(ones[0]) if len(ones) else num_seqs,
        state_slots=state_slots,
        has_initial_state=has_initial_state,
    )


def pad_rows_in_front(arrays: StepArrays, rows: int) -> tuple[StepArrays, np.ndarray] | None:
    """The batch as `rows` rows per sequence, each sequence's rows moved to the end of its
    span behind padding rows, and where each token went; None if a sequence has more rows,
    or too little context to sit the padding on, or recurrent state slots (a hybrid model's
    state would take the padding rows in), or more rows than attention takes as decodes
    (MAX_DECODE_QUERIES: the prefill kernels read a step's new keys from its dense K/V,
    which a padding row computes from no real token).

    A padding row sits at a position of the sequence just before its first new one: it
    reads that position's cached context and writes nowhere (slot -1), so the rows after it
    see what they saw before. A ragged step (a drafter's catch-up after a verify that kept
    different numbers of tokens) then replays a uniform step's CUDA graph, whose outputs
    are each sequence's last row, still its own last token."""
    query_lens = np.diff(arrays.query_start_loc).astype(np.int64)
    padding = rows - query_lens
    if (
        arrays.state_slots is not None
        or rows > MAX_DECODE_QUERIES
        or (padding < 0).any()
        or ((arrays.seq_lens - query_lens) < padding).any()
    ):
        return None
    num_seqs = arrays.num_seqs
    num_rows = num_seqs * rows
    token_rows = np.arange(arrays.num_tokens) + np.repeat(
        np.arange(num_seqs) * rows + padding - arrays.query_start_loc[:-1], query_lens
    )
    input_ids = np.zeros(num_rows, np.int64)
    input_ids[token_rows] = arrays.input_ids
    slot_mapping = np.full((arrays.slot_mapping.shape[0], num_rows), -1, np.int64)
    slot_mapping[:, token_rows] = arrays.slot_mapping
    padded = replace(
        arrays,
        input_ids=input_ids,
        positions=np.repeat(arrays.seq_lens.astype(np.int64) - rows, rows)
        + np.tile(np.arange(rows), num_seqs),
        slot_mapping=slot_mapping,
        query_start_loc=(np.arange(num_seqs + 1) * rows).astype(np.int32),
        num_decodes=num_seqs if rows == 1 else 0,
    )
    return padded, token_rows


def upload(
    arrays: StepArrays, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) on `device`, from one host->device copy."""
    parts = [
        arrays.input_ids,
        arrays.positions,
        arrays.slot_mapping.ravel(),
        arrays.query_start_loc,
        arrays.seq_lens,
        arrays.block_table.ravel(),
    ]
    host = torch.from_numpy(np.concatenate(parts, dtype=np.int64))
    packed = host.to(device, non_blocking=True)  # pageable: staged at once, no sync
    ids, pos, slots, qsl, lens, table = packed.split([len(p) for p in parts])
    qsl_cpu = torch.from_numpy(arrays.query_start_loc)
    lens_cpu = torch.from_numpy(arrays.seq_lens)
    slots = slots.view(arrays.slot_mapping.shape)
    table = table.view(arrays.block_table.shape).int()
    metadata = AttentionMetadata(
        query_start_loc=qsl.int(),
        seq_lens=lens.int(),
        block_table=table[:, 0],
        slot_mapping=slots[0],
        kv_group_tables=kv_group_tables(table, slots),
        num_decodes=arrays.num_decodes,
        num_decode_tokens=arrays.num_decodes,
        max_query_len=int(np.diff(arrays.query_start_loc).max(initial=0)),
        max_seq_len=int(arrays.seq_lens.max(initial=0)),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=lens_cpu,
    )
    if arrays.state_slots is not None:
        metadata.state_slots = torch.from_numpy(arrays.state_slots).to(device)
        metadata.has_initial_state = torch.from_numpy(arrays.has_initial_state).to(device)
    return ids, pos, metadata


def kv_group_tables(
    table: torch.Tensor, slots: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...] | None:
    """Each KV-cache group's (block table, slot mapping) from [B, G, width] and [G, T];
    None for one group (every layer reads the metadata's own)."""
    if table.shape[1] == 1:
        return None
    return tuple((table[:, g], slots[g]) for g in range(table.shape[1]))
