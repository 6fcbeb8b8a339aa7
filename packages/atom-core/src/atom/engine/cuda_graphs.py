"""CUDA graphs of pure-decode steps, captured once per padded batch size.

A decode step is dominated by kernel launches at small batch sizes; replaying a captured
graph removes them. Inputs live in static buffers; a batch is padded to the next captured
size with rows that write nowhere (slot -1) and read one page.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.engine.model_runner import StepInput
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.kernels.policy import selected_backend


def graph_blockers(model: nn.Module, device: torch.device) -> list[str]:
    """Parts of the model that cannot be captured: torch reference ops that read sequence
    lengths or expert counts on the host (modules declare `cuda_graph_safe = False`)."""
    blockers = {
        type(m).__name__ for m in model.modules() if not getattr(m, "cuda_graph_safe", True)
    }
    if selected_backend("paged_attention", device) == "torch":
        blockers.add("torch paged attention")
    return sorted(blockers)


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += range(16, max_batch_size, 16)
    return sorted(set(sizes) | {max_batch_size})


class DecodeGraphs:
    def __init__(
        self, model: nn.Module, max_batch_size: int, max_blocks: int, block_size: int, device
    ):
        self.max_batch_size = max_batch_size
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        n = max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture(model)

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            num_decodes=bs,
            num_decode_tokens=bs,
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
        )

    @torch.inference_mode()
    def _capture(self, model: nn.Module) -> None:
        pool = None
        for bs in reversed(capture_sizes(self.max_batch_size)):
            metadata = self._metadata(bs)
            with set_forward_context(metadata):
                model(self.input_ids[:bs], self.positions[:bs])  # warm-up compiles the kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = (graph, output)

    def can_run(self, batch: list[StepInput]) -> bool:
        return (
            len(batch) <= self.max_batch_size
            and all(len(item.token_ids) == 1 for item in batch)
            and all(len(item.block_table) <= self.max_blocks for item in batch)
        )

    def run(self, batch: list[StepInput]) -> torch.Tensor:
        """Hidden states [len(batch), hidden] of a pure-decode batch."""
        bs = next(size for size in sorted(self.graphs) if size >= len(batch))
        n = len(batch)
        positions = [item.start_position for item in batch]
        table = torch.zeros(bs, self.max_blocks, dtype=torch.int32)
        for i, item in enumerate(batch):
            table[i, : len(item.block_table)] = torch.tensor(item.block_table, dtype=torch.int32)
        slots = [
            item.block_table[p // self.block_size] * self.block_size + p % self.block_size
            for item, p in zip(batch, positions)
        ]
        pad = bs - n
        self.input_ids[:bs].copy_(torch.tensor([item.token_ids[0] for item in batch] + [0] * pad))
        self.positions[:bs].copy_(torch.tensor(positions + [0] * pad))
        self.slot_mapping[:bs].copy_(torch.tensor(slots + [-1] * pad))
        self.seq_lens[:bs].copy_(
            torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32)
        )
        self.block_table[:bs].copy_(table)
        graph, output = self.graphs[bs]
        graph.replay()
        return output[:n]
