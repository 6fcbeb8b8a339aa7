"""CUDA graphs of uniform steps: every sequence feeds the same number of new tokens.

A step at small batch sizes is dominated by kernel launches; replaying a captured graph
removes them. One `StepGraphs` holds the graphs of one step function at one number of
query tokens per sequence (1: a decode; k + 1: a speculative verify step, its last token
and k drafts; the drafter's steps too), captured once per padded batch size. Inputs live
in static buffers (one pinned host buffer, one upload per step); a batch is padded to the
next captured size with sequences that write nowhere (slot -1) and read one page (hybrid
models: their state slots are static inputs too, and padding rows update the scratch
row, atom.engine.state_cache). Tensors already on the device (a drafter's hidden states)
are copied into static device buffers. A hybrid target's verify step keeps its Gated
DeltaNet states for the rollback in static buffers too (state_rollback.StaticCheckpoints).
Under data-parallel attention every rank replays one shared size
(atom.engine.data_parallel_graphs).

With `capture=False` nothing is captured: each "replay" runs the step function on the
same static, padded buffers, so the CPU tests check that path. Whether a model can be
captured at all is `atom.cuda_graphs.graph_blockers`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from atom.engine.staged_buffers import StagedBuffers
from atom.engine.state_cache import PADDING_SLOT
from atom.engine.step_arrays import StepArrays, TokenFeed, kv_group_tables
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.speculative.state_rollback import StaticCheckpoints

# (input_ids [T], positions [T], *device inputs [T, ...]) -> outputs, each with one row
# per token or one per sequence.
StepFunction = Callable[..., tuple[torch.Tensor, ...]]


def capture_sizes(max_batch_size: int) -> list[int]:
    """Dense at small sizes, where padding would cost the most relative time."""
    steps = [*range(16, 257, 16), *range(288, 513, 32), *range(576, max_batch_size, 64)]
    sizes = {1, 2, 4, 8, *steps, max_batch_size}
    return sorted(s for s in sizes if s <= max_batch_size)


class StepGraphs:
    def __init__(
        self,
        step: StepFunction,
        query_len: int,
        max_batch_size: int,
        max_blocks: int,
        block_size: int,
        device,
        num_kv_groups: int = 1,
        hybrid: bool = False,
        device_inputs: dict[str, tuple[torch.dtype, int]] | None = None,
        capture: bool = True,
        pool=None,
        keeps_states: bool = False,
    ):
        """query_len: new tokens per sequence; num_kv_groups: block tables and slot
        mappings per sequence (kv_groups.py); hybrid: the step reads state slots;
        device_inputs: name -> (dtype, width) of per-token inputs passed to `run` as
        device tensors; pool: a graph memory pool to share with other StepGraphs (their
        outputs are valid until the next replay of any of them); keeps_states: a hybrid
        target's verify step, whose DeltaNet layers keep every sequence's states in
        `state_checkpoints` (valid, like the outputs, until the next step through
        these buffers)."""
        self.step = step
        self.query_len = q = query_len
        self.max_batch_size = max_batch_size
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.num_kv_groups = groups = num_kv_groups
        self.hybrid = hybrid
        self.replays = 0
        n = max_batch_size
        self.inputs = StagedBuffers(
            {
                "input_ids": (torch.int64, (n * q,)),
                "positions": (torch.int64, (n * q,)),
                "slot_mapping": (torch.int64, (groups, n * q)),
                "seq_lens": (torch.int32, (n,)),
                "query_start_loc": (torch.int32, (n + 1,)),
                "state_slots": (torch.int32, (n,)),  # hybrid models' state pool rows
                "has_initial_state": (torch.bool, (n,)),
                # Last: uploads stop at row bs.
                "block_table": (torch.int32, (n, groups, max_blocks)),
            },
            device,
        )
        host = self.inputs.host()
        host["query_start_loc"][:] = np.arange(n + 1) * q  # uniform: never changes
        host["seq_lens"][:] = q
        host["slot_mapping"][:] = -1
        host["state_slots"][:] = PADDING_SLOT
        host["has_initial_state"][:] = True
        self.inputs.upload()
        self.device_inputs = {
            name: torch.zeros(n * q, width, dtype=dtype, device=device)
            for name, (dtype, width) in (device_inputs or {}).items()
        }
        self.state_checkpoints = (
            StaticCheckpoints(self.inputs.device["state_slots"], q) if keeps_states else None
        )
        self.sizes = capture_sizes(max_batch_size)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        if capture:
            self._capture(pool)

    @property
    def pool(self):
        return self.graphs[self.sizes[0]][0].pool() if self.graphs else None

    def _metadata(self, bs: int) -> AttentionMetadata:
        d, q = self.inputs.device, self.query_len
        table, slots = d["block_table"][:bs], d["slot_mapping"][:, : bs * q]
        return AttentionMetadata(
            query_start_loc=d["query_start_loc"][: bs + 1],
            seq_lens=d["seq_lens"][:bs],
            block_table=table[:, 0],
            slot_mapping=slots[0],
            kv_group_tables=kv_group_tables(table, slots),
            # Several tokens per sequence take the prefill path, over their cached context.
            num_decodes=bs if q == 1 else 0,
            num_decode_tokens=bs if q == 1 else 0,
            max_query_len=q,
            max_seq_len=self.max_blocks * self.block_size,
            state_slots=d["state_slots"][:bs] if self.hybrid else None,
            has_initial_state=d["has_initial_state"][:bs] if self.hybrid else None,
            state_checkpoints=self.state_checkpoints,
        )

    def _call(self, bs: int) -> tuple[torch.Tensor, ...]:
        tokens = bs * self.query_len
        d = self.inputs.device
        extra = [buffer[:tokens] for buffer in self.device_inputs.values()]
        with set_forward_context(self._metadata(bs)):
            return self.step(d["input_ids"][:tokens], d["positions"][:tokens], *extra)

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        for bs in reversed(self.sizes):
            self._call(bs)  # warm-up compiles the kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._call(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, outputs)

    def padded_size(self, num_seqs: int) -> int:
        """The captured batch size a step of `num_seqs` sequences replays."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def can_run(self, arrays: StepArrays) -> bool:
        q = self.query_len
        return (
            0 < arrays.num_seqs <= self.max_batch_size
            and arrays.num_tokens == arrays.num_seqs * q
            and bool((np.diff(arrays.query_start_loc) == q).all())
            and arrays.block_table.shape[1] == self.num_kv_groups
            and arrays.block_table.shape[2] <= self.max_blocks
        )

    def run(
        self,
        arrays: StepArrays,
        feed: TokenFeed | None = None,
        device_inputs: dict[str, torch.Tensor] | None = None,
        batch_size: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The step function's outputs for the batch's rows (padding rows cut off): views
        of static buffers, valid until the next replay. batch_size: the captured size to
        replay instead of the batch's own (`padded_size`): data-parallel ranks all replay
        one size, a rank with no sequences too (atom.engine.data_parallel_graphs)."""
        n, q = arrays.num_seqs, self.query_len
        bs = self.padded_size(n) if batch_size is None else batch_size
        t, padded = n * q, bs * q
        host = self.inputs.host()
        host["input_ids"][:t] = arrays.input_ids
        host["positions"][:t] = arrays.positions
        host["slot_mapping"][:, :t] = arrays.slot_mapping
        host["seq_lens"][:n] = arrays.seq_lens
        # Entries past a row's last page are never read (seq_lens bounds them), so stale
        # values from earlier steps may stay; padding rows read page 0 and write nowhere.
        host["block_table"][:n, :, : arrays.block_table.shape[2]] = arrays.block_table
        if arrays.state_slots is not None:
            host["state_slots"][:n] = arrays.state_slots
            host["has_initial_state"][:n] = arrays.has_initial_state
        host["input_ids"][t:padded] = 0
        host["positions"][t:padded] = np.tile(np.arange(q), bs - n)
        host["slot_mapping"][:, t:padded] = -1
        host["seq_lens"][n:bs] = q  # no context: padding sequences read only their own rows
        host["block_table"][n:bs, :, 0] = 0
        host["state_slots"][n:bs] = PADDING_SLOT  # padding rows update the scratch row
        host["has_initial_state"][n:bs] = True
        self.inputs.upload(self.inputs.end_of("block_table", bs))
        for name, tensor in (device_inputs or {}).items():
            self.device_inputs[name][:t].copy_(tensor)
        if feed is not None:
            feed.apply(self.inputs.device["input_ids"])
        self.replays += 1
        if self.capture:
            graph, outputs = self.graphs[bs]
            graph.replay()
        else:
            outputs = self._call(bs)
        return tuple(out[: out.shape[0] // bs * n] for out in outputs)
