"""The host-neutral description of one forward step (docs/architecture.md).

Every host's bridge (the native engine's model runner, atom_vllm.step, atom_sglang.model)
fills one complete `AttentionMetadata` per step (every KV-cache group, the state slots of
linear-attention layers, the tokens' positions) and sets it with `set_forward_context`;
ATOM's impls read only that (`get_forward_context()`) and never learn which host runs
them. Where a host's own attention backend attends instead of ATOM's kernels (SGLang's
backends under atom-sglang), the bridge sets that step's `HostAttention` in its place:
the layers still read the step only from here, and never hold the host's batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from atom.speculative.state_rollback import StateCheckpoints


class KVGroupTables(NamedTuple):
    """Where the layers of one KV-cache group keep their pages: each sequence's block table,
    each new token's slot, and, for a group of state layers whose host gives every group
    its own rows (vLLM's mamba groups), each sequence's state row."""

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Paged-attention description of a batch; decodes come first.

    query_start_loc: [B+1] int32, cumulative new-token counts per sequence.
    seq_lens:        [B] int32, cached context + new tokens per sequence.
    block_table:     [B, max_blocks] int32, KV page ids per sequence.
    slot_mapping:    [T] int64, cache slot of each new token (-1: padding, not written).
    positions:       [T] int64, position of each new token (what the model was called
                     with); set by hosts whose attention op carries only q/k/v (vLLM),
                     for impls that rotate q/k in the kernel that writes the cache.
    kv_group_tables: one `KVGroupTables` (or (block_table, slot_mapping) pair) per
                     KV-cache group, where the layers keep different pages (sliding-window
                     layers keep only their window's: the native engine's window groups,
                     SGLang's sliding-window pool, vLLM's groups); entry 0 is block_table
                     and slot_mapping. None: every layer reads those two.
    state_slots:     [B] int32, each sequence's row in the per-request state pools of
                     hybrid models (Gated DeltaNet conv + recurrent states); None otherwise.
    has_initial_state: [B] bool, whether that row holds the sequence's state so far (False:
                     its first chunk, or a recompute after preemption: start from zeros).
    state_checkpoints: a speculative verify step of a hybrid model: the sequences whose
                     states its Gated DeltaNet layers copy, with the inputs of their rows,
                     before they mix (the verified ones; under CUDA graphs every sequence
                     of the padded batch; atom.speculative.state_rollback); else None.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    # Host-side copies so reference kernels can loop without device syncs.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    kv_group_tables: tuple[KVGroupTables | tuple[torch.Tensor, torch.Tensor], ...] | None = None
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    state_checkpoints: StateCheckpoints | None = None
    _group_views: dict[int, AttentionMetadata] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def for_kv_group(self, group: int) -> AttentionMetadata:
        """The step as a layer of KV-cache group `group` sees it: that group's block table,
        slot mapping and (where the group has its own) state rows, built once per step and
        group (every layer of the group asks)."""
        if group == 0:
            return self
        view = self._group_views.get(group)
        if view is None:
            num_groups = len(self.kv_group_tables or ((self.block_table, self.slot_mapping),))
            if not 0 < group < num_groups:
                raise ValueError(
                    f"kv_group={group}: the step's metadata has tables for {num_groups} "
                    "KV-cache group(s) (kv_group_tables)"
                )
            tables = KVGroupTables(*self.kv_group_tables[group])
            view = replace(
                self,
                block_table=tables.block_table,
                slot_mapping=tables.slot_mapping,
                state_slots=self.state_slots if tables.state_slots is None else tables.state_slots,
                kv_group_tables=None,
            )
            self._group_views[group] = view
        return view

    def begin_forward(self) -> None:
        """Drops what earlier forwards derived from this object's tensors (the token bounds,
        the group views), so the forward about to run derives it again from their current
        contents. A host that reuses one object over static buffers (CUDA-graph warm-up,
        then capture, then replays) thus records those ops in the captured graph instead
        of baking in the warm-up batch's values."""
        self.__dict__.pop("query_token_bounds", None)
        self._group_views.clear()

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @cached_property
    def prefills_have_context(self) -> bool:
        """Whether any prefill sequence has cached context, from the host copies (no device
        sync; without them, assumed). Once per step: every layer's attention asks."""
        if self.seq_lens_cpu is None or self.query_start_loc_cpu is None:
            return True
        first, end = self.num_decodes, self.num_seqs
        starts = self.query_start_loc_cpu.numpy()  # numpy: a few us, torch ops ~20
        new_tokens = int(starts[end] - starts[first])
        return int(self.seq_lens_cpu.numpy()[first:end].sum()) > new_tokens  # contexts >= 0

    @cached_property
    def query_token_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence [T], keys [T]) int32 on the device: each query token's sequence and how
        many keys it sees (its position + 1). Built once per step from query_start_loc and
        seq_lens with static shapes (no sync), for kernels that run one program per query
        token (the sparse-attention indexer); tokens past the last sequence (a host's
        padding) see none."""
        starts = self.query_start_loc
        tokens = torch.arange(self.num_tokens, device=starts.device, dtype=starts.dtype)
        seq = torch.searchsorted(starts[1:], tokens, right=True).clamp_(max=self.num_seqs - 1)
        keys = self.seq_lens[seq] - (starts[seq + 1] - tokens) + 1
        keys = torch.where(tokens < starts[-1], keys, 0)
        return seq.int(), keys.int()

    def host_query_start_loc(self) -> list[int]:
        src = (
            self.query_start_loc_cpu
            if self.query_start_loc_cpu is not None
            else self.query_start_loc
        )
        return src.tolist()

    def host_seq_lens(self) -> list[int]:
        src = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens
        return src.tolist()

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds metadata from Python lists; decode rows (query len 1) must come first."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        width = max((len(b) for b in block_tables), default=0) or 1
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        qsl_cpu = torch.tensor(starts, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        return AttentionMetadata(
            query_start_loc=qsl_cpu.to(device),
            seq_lens=seq_cpu.to(device),
            block_table=table.to(device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )


class HostAttention(Protocol):
    """The host's own attention backend for one step, with the host's batch bound in by
    the bridge: an impl hands over only the host attention layer it wraps (SGLang's
    `RadixAttention`), q, k and v in that layer's layout, and the layer's keyword
    arguments, and gets the layer's output."""

    def __call__(
        self, host_layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /, **kwargs: Any
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ForwardContext:
    """The step as ATOM's layers see it: `attn_metadata` where ATOM's impls attend,
    `host_attention` where the host's own backend does; at most one of them."""

    attn_metadata: AttentionMetadata | None = None
    host_attention: HostAttention | None = None


_EMPTY = ForwardContext()
_current: ForwardContext = _EMPTY


def get_forward_context() -> ForwardContext:
    return _current


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, *, host_attention: HostAttention | None = None
) -> Iterator[ForwardContext]:
    global _current
    if attn_metadata is not None and host_attention is not None:
        raise ValueError("a step is attended by ATOM's impls or by the host's, not both")
    if attn_metadata is not None:
        attn_metadata.begin_forward()
    previous = _current
    _current = ForwardContext(attn_metadata=attn_metadata, host_attention=host_attention)
    try:
        yield _current
    finally:
        _current = previous
