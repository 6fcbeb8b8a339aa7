"""The SGLang bridge's builder: one ForwardBatch -> one complete `AttentionMetadata`.

SGLang keeps no block tables: each request owns a row of `req_to_token`, which maps its
positions to KV slots; the step's new tokens go to `out_cache_loc`. The builder turns that
into ATOM's schema through `atom.hosts.token_table` (page size 1 or the configured one),
and adds to the same object what the step's layers need besides:

* hybrid SWA pool (`SWAKVPool`, models with sliding-window and full layers, e.g.
  GPT-OSS): two MHA pools. `req_to_token` and `out_cache_loc` name slots of the full
  pool; a sliding layer's slot is their translation (`translate_loc_from_full_to_swa`),
  and SGLang frees the sliding pool's slots of tokens that left the window (they
  translate to its padding slot 0, which the kernels may read but mask). The translated
  block table and slot mapping are KV-cache group 1 (`kv_group_tables`); every layer
  that `layers_mapping` marks sliding reads group 1 (`kv_group`).
* hybrid mamba pool (Gated DeltaNet + attention, e.g. Qwen3-Next): each request's row of
  SGLang's mamba pool (`HybridReqToTokenPool`: `req_pool_indices` -> mamba indices) as
  `state_slots`, and `has_initial_state` from the tokens computed before the step
  (`atom.hosts.state.with_state_slots`).
* the step's `positions`.

A speculative verify step (TARGET_VERIFY: each request's last token and its chain of
drafts, `verify_row_length`) is the same schema: extend rows over the cached context,
whose seq_lens count the drafts (SGLang's stop before them). It brings no new field.

CUDA graphs (decode): `init_graph_buffers` allocates static buffers (with a hybrid SWA
pool, translated copies of the block table and slot mapping too); `build_for_graph`
refills them from the (padded) batch before capture and before every replay, so the
captured kernels read the same addresses each time. The metadata objects over them are
built once per captured batch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from atom.forward_context import AttentionMetadata, KVGroupTables
from atom.hosts.state import with_state_slots
from atom.hosts.token_table import block_table_from_token_table, metadata_from_token_table

FULL_GROUP, SLIDING_GROUP = 0, 1


def translate_pages(
    block_table: torch.Tensor,
    translate_slots: Callable[[torch.Tensor], torch.Tensor],
    page_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full pool's page ids -> the sliding-window pool's, int32. SGLang allocates
    both sides of a page alike (a token keeps its in-page offset), so a page's first
    slot translates to its sliding page's first slot. With `out`, written there."""
    first_slots = block_table.long() * page_size
    pages = translate_slots(first_slots) // page_size
    if out is None:
        return pages.to(torch.int32)
    return out.copy_(pages)


def sliding_tables(
    metadata: AttentionMetadata,
    translate_slots: Callable[[torch.Tensor], torch.Tensor],
    page_size: int,
) -> KVGroupTables:
    """`metadata`'s block table and slot mapping in the sliding-window pool (padding -1
    stays -1: SGLang's translation table ends with a -1 sentinel)."""
    return KVGroupTables(
        translate_pages(metadata.block_table, translate_slots, page_size),
        translate_slots(metadata.slot_mapping),
    )


def verify_row_length(spec_info: Any) -> int:
    """Tokens per request in a speculative verify step (SGLang's TARGET_VERIFY): the last
    accepted token and its drafts. ATOM's schema carries them as extend rows over the
    request's cached context, causally masked: the visibility of a chain of drafts
    (`tree_topk == 1`: EAGLE / NEXTN with speculative_eagle_topk=1). A token tree (EAGLE
    topk > 1, NGRAM) lets a draft see only its ancestors, a mask ATOM's kernels do not take.
    """
    if spec_info.tree_topk != 1:
        raise NotImplementedError(
            "ATOM's attention backend verifies chains of drafts only (EAGLE / NEXTN with "
            f"speculative_eagle_topk=1); this step's drafts form a tree ({type(spec_info).__name__}, "
            f"tree_topk={spec_info.tree_topk})"
        )
    return spec_info.draft_token_num


class SglangMetadataBuilder:
    """ATOM's step metadata from SGLang's batches, for one model runner's pools."""

    def __init__(self, model_runner: Any, device: torch.device):
        self.device = device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        pool = model_runner.token_to_kv_pool
        self.swa_pool: SWAKVPool | None = pool if isinstance(pool, SWAKVPool) else None
        self.sliding_layers: frozenset[int] = frozenset()
        if self.swa_pool is not None:
            mapping = self.swa_pool.layers_mapping
            self.sliding_layers = frozenset(i for i, (_, is_swa) in mapping.items() if is_swa)
        self.has_state_pool = hasattr(self.req_to_token_pool, "get_mamba_indices")
        self.max_context_len = self.req_to_token.shape[1]
        self.graph_buffers: dict[str, torch.Tensor] | None = None
        self.graph_metadata: dict[int, AttentionMetadata] = {}  # by captured batch size

    def kv_group(self, layer_id: int) -> int:
        """The KV-cache group whose tables layer `layer_id` reads."""
        return SLIDING_GROUP if layer_id in self.sliding_layers else FULL_GROUP

    def build(self, forward_batch: Any) -> AttentionMetadata | None:
        """The step's metadata; None for an idle batch (no requests)."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            return None
        if mode.is_draft_extend_v2():
            raise NotImplementedError(
                "ATOM's attention backend does not run SGLang's draft models: name one of "
                "SGLang's own with speculative_draft_attention_backend"
            )
        bs = forward_batch.batch_size
        device = forward_batch.seq_lens.device
        seq_lens, seq_lens_cpu = forward_batch.seq_lens, forward_batch.seq_lens_cpu
        if mode.is_target_verify():
            if self.has_state_pool:
                raise NotImplementedError(
                    "ATOM's Gated DeltaNet layers in SGLang keep one state per request, not "
                    "one per draft token: no speculative decoding"
                )
            # SGLang's seq_lens stop before the drafts; ATOM's count the step's tokens.
            tokens = verify_row_length(forward_batch.spec_info)
            query_lens = torch.full((bs,), tokens, dtype=torch.int32, device=device)
            query_lens_cpu = torch.full((bs,), tokens, dtype=torch.int32)
            seq_lens = seq_lens + tokens
            seq_lens_cpu = seq_lens_cpu + tokens if seq_lens_cpu is not None else None
        elif mode.is_decode():
            query_lens = torch.ones(bs, dtype=torch.int32, device=device)
            query_lens_cpu = torch.ones(bs, dtype=torch.int32)
        else:
            query_lens = forward_batch.extend_seq_lens
            query_lens_cpu = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int32)
        metadata = metadata_from_token_table(
            self.req_to_token,
            forward_batch.req_pool_indices,
            seq_lens,
            query_lens,
            forward_batch.out_cache_loc,
            self.page_size,
            seq_lens_cpu=seq_lens_cpu[:bs] if seq_lens_cpu is not None else None,
            query_lens_cpu=query_lens_cpu,
            all_decodes=mode.is_decode(),
        )
        metadata.positions = getattr(forward_batch, "positions", None)
        if self.swa_pool is not None:
            metadata.kv_group_tables = (
                KVGroupTables(metadata.block_table, metadata.slot_mapping),
                sliding_tables(
                    metadata, self.swa_pool.translate_loc_from_full_to_swa, self.page_size
                ),
            )
        if self.has_state_pool:
            rows = forward_batch.req_pool_indices[:bs]
            metadata = with_state_slots(
                metadata,
                self.req_to_token_pool.get_mamba_indices(rows),
                seq_lens[:bs] - query_lens,
            )
        return metadata

    def init_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        width = -(-self.max_context_len // self.page_size)
        kw = {"device": self.device}
        self.graph_buffers = {
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, **kw),
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, **kw),
            "block_table": torch.zeros(max_bs, width, dtype=torch.int32, **kw),
            "slot_mapping": torch.zeros(max_num_tokens, dtype=torch.int64, **kw),
        }
        if self.swa_pool is not None:
            for name in ("block_table", "slot_mapping"):
                self.graph_buffers[f"swa_{name}"] = torch.zeros_like(self.graph_buffers[name])
        self.graph_metadata = {}

    def build_for_graph(self, forward_batch: Any) -> AttentionMetadata:
        """Refills the static buffers from a padded decode batch (capture and replay) and
        returns the metadata over them. No state rows: ATOM's hybrid models refuse decode
        graphs (atom_sglang.model); SGLang's own hybrids read their rows themselves."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError("ATOM's backend captures decode steps only")
        buffers = self.graph_buffers
        bs = forward_batch.batch_size
        width = buffers["block_table"].shape[1]
        buffers["seq_lens"][:bs].copy_(forward_batch.seq_lens[:bs])
        # On replay SGLang pads seq_lens and the request rows to the graph's size, but
        # out_cache_loc keeps the real tokens only: padded rows write nowhere.
        real = min(bs, forward_batch.out_cache_loc.shape[0])
        buffers["slot_mapping"][:real].copy_(forward_batch.out_cache_loc[:real])
        buffers["slot_mapping"][real:bs].fill_(-1)
        block_table_from_token_table(
            self.req_to_token,
            forward_batch.req_pool_indices[:bs],
            self.page_size,
            width * self.page_size,
            out=buffers["block_table"],
        )
        if self.swa_pool is not None:
            translate = self.swa_pool.translate_loc_from_full_to_swa
            buffers["swa_slot_mapping"][:bs].copy_(translate(buffers["slot_mapping"][:bs]))
            translate_pages(
                buffers["block_table"][:bs],
                translate,
                self.page_size,
                out=buffers["swa_block_table"][:bs],
            )
        metadata = self.graph_metadata.get(bs)
        if metadata is None:
            metadata = self.graph_metadata[bs] = self._graph_metadata(bs, forward_batch)
        return metadata

    def _graph_metadata(self, bs: int, forward_batch: Any) -> AttentionMetadata:
        """The metadata of the graph for `bs` requests, built once (at capture) over the
        static buffers; replays only refill the buffers. Its bounds are graph-stable: the
        kernels' launch grids must not depend on the batch being replayed."""
        buffers = self.graph_buffers
        width = buffers["block_table"].shape[1]
        metadata = AttentionMetadata(
            query_start_loc=buffers["query_start_loc"][: bs + 1],
            seq_lens=buffers["seq_lens"][:bs],
            block_table=buffers["block_table"][:bs],
            slot_mapping=buffers["slot_mapping"][:bs],
            num_decodes=bs,
            num_decode_tokens=bs,
            max_query_len=1,
            max_seq_len=width * self.page_size,
            # SGLang's graph runner captures with its static positions buffer.
            positions=getattr(forward_batch, "positions", None),
        )
        if self.swa_pool is not None:
            metadata.kv_group_tables = (
                KVGroupTables(metadata.block_table, metadata.slot_mapping),
                KVGroupTables(buffers["swa_block_table"][:bs], buffers["swa_slot_mapping"][:bs]),
            )
        return metadata
