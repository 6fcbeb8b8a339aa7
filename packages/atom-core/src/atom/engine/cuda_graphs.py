"""CUDA graphs of pure-decode steps, captured once per padded batch size.

A decode step is dominated by kernel launches at small batch sizes; replaying a captured
graph removes them. Inputs live in static buffers (one pinned host buffer, one upload per
step); a batch is padded to the next captured size with rows that write nowhere (slot -1)
and read one page (hybrid models: their state slots are static inputs too, and padding
rows update the scratch row, atom.engine.state_cache). Whether a model can be captured at all is `atom.cuda_graphs.graph_blockers`.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from atom.engine.staged_buffers import StagedBuffers
from atom.engine.state_cache import PADDING_SLOT, is_hybrid
from atom.engine.step_arrays import StepArrays, TokenFeed, kv_group_tables
from atom.forward_context import AttentionMetadata, set_forward_context


def capture_sizes(max_batch_size: int) -> list[int]:
    """Dense at small sizes, where padding would cost the most relative time."""
    steps = [*range(16, 257, 16), *range(288, 513, 32), *range(576, max_batch_size, 64)]
    sizes = {1, 2, 4, 8, *steps, max_batch_size}
    return sorted(s for s in sizes if s <= max_batch_size)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int,
        max_blocks: int,
        block_size: int,
        device,
        num_kv_groups: int = 1,
    ):
        """num_kv_groups: block tables and slot mappings per sequence (kv_groups.py)."""
        self.max_batch_size = max_batch_size
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        n, groups = max_batch_size, num_kv_groups
        self.inputs = StagedBuffers(
            {
                "input_ids": (torch.int64, (n,)),
                "positions": (torch.int64, (n,)),
                "slot_mapping": (torch.int64, (groups, n)),
                "seq_lens": (torch.int32, (n,)),
                "query_start_loc": (torch.int32, (n + 1,)),
                "state_slots": (torch.int32, (n,)),  # hybrid models' state pool rows
                "has_initial_state": (torch.bool, (n,)),  # every decode has its state
                # Last: uploads stop at row bs.
                "block_table": (torch.int32, (n, groups, max_blocks)),
            },
            device,
        )
        host = self.inputs.host()
        host["query_start_loc"][:] = range(n + 1)
        host["seq_lens"][:] = 1
        host["slot_mapping"][:] = -1
        host["state_slots"][:] = PADDING_SLOT
        host["has_initial_state"][:] = True
        self.hybrid = is_hybrid(model)
        self.inputs.upload()
        self.sizes = capture_sizes(max_batch_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture(model)

    def _metadata(self, bs: int) -> AttentionMetadata:
        d = self.inputs.device
        table, slots = d["block_table"][:bs], d["slot_mapping"][:, :bs]
        return AttentionMetadata(
            query_start_loc=d["query_start_loc"][: bs + 1],
            seq_lens=d["seq_lens"][:bs],
            block_table=table[:, 0],
            slot_mapping=slots[0],
            kv_group_tables=kv_group_tables(table, slots),
            num_decodes=bs,
            num_decode_tokens=bs,
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            state_slots=d["state_slots"][:bs] if self.hybrid else None,
            has_initial_state=d["has_initial_state"][:bs] if self.hybrid else None,
        )

    @torch.inference_mode()
    def _capture(self, model: nn.Module) -> None:
        pool = None
        ids, positions = self.inputs.device["input_ids"], self.inputs.device["positions"]
        for bs in reversed(self.sizes):
            with set_forward_context(self._metadata(bs)):
                model(ids[:bs], positions[:bs])  # warm-up compiles the kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = model(ids[:bs], positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = (graph, output)

    def can_run(self, arrays: StepArrays) -> bool:
        return (
            arrays.num_decodes == arrays.num_seqs <= self.max_batch_size
            and arrays.block_table.shape[1] == self.num_kv_groups
            and arrays.block_table.shape[2] <= self.max_blocks
        )

    def run(self, arrays: StepArrays, feed: TokenFeed | None = None) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a pure-decode batch."""
        n = arrays.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        host = self.inputs.host()
        host["input_ids"][:n] = arrays.input_ids
        host["positions"][:n] = arrays.positions
        host["slot_mapping"][:, :n] = arrays.slot_mapping
        host["seq_lens"][:n] = arrays.seq_lens
        # Entries past a row's last page are never read (seq_lens bounds them), so stale
        # values from earlier steps may stay; padding rows read page 0 and write nowhere.
        host["block_table"][:n, :, : arrays.block_table.shape[2]] = arrays.block_table
        if arrays.state_slots is not None:
            host["state_slots"][:n] = arrays.state_slots
        host["input_ids"][n:bs] = 0
        host["positions"][n:bs] = 0
        host["slot_mapping"][:, n:bs] = -1
        host["seq_lens"][n:bs] = 1
        host["block_table"][n:bs, :, 0] = 0
        host["state_slots"][n:bs] = PADDING_SLOT  # padding rows update the scratch row
        self.inputs.upload(self.inputs.end_of("block_table", bs))
        if feed is not None:
            feed.apply(self.inputs.device["input_ids"])
        graph, output = self.graphs[bs]
        graph.replay()
        return output[:n]
