"""ATOM's attention backend for SGLang (`attention_backend="atom"`), MHA and MLA.

SGLang calls `init_forward_metadata(forward_batch)` once per forward; the backend turns
the batch into `atom.forward_context.AttentionMetadata` (docs/architecture.md) through the
request-to-token table (`atom.hosts.token_table`). Every `RadixAttention` layer then
calls `forward_extend` / `forward_decode`, which write the new K/V into SGLang's own
KV pool with ATOM's cache-write kernel and attend with ATOM's kernels (the kernel
policy picks torch on CPU, Triton on GPU), over the pool viewed as pages:

* MHA pool (`MHATokenToKVPool`, NHD layout): key/value `[slots, Hkv, D]` per layer
  -> `[slots / P, P, Hkv, D]`, `atom.kernels.paged_attention`.
* MLA pool (`MLATokenToKVPool`): one latent row `[slots, 1, L + R]` per token, which
  `mla_cache` views as ATOM's MLA cache. ATOM's MLA layers run ATOM's MLA step over it
  (`atom_sglang.attention_layer`). SGLang's own MLA layers call attention in the
  weight-absorbed form (q `[T, H, L + R]`, values = the first L channels): decode steps
  run `atom.kernels.mla_decode_attention`, extend steps the same latent-space MQA
  through `paged_attention`.
* Hybrid SWA pool (`SWAKVPool`, models with sliding-window and full layers, e.g.
  GPT-OSS): two MHA pools. `req_to_token` and `out_cache_loc` name slots of the full
  pool; a sliding layer's slot is their translation (`translate_loc_from_full_to_swa`),
  and SGLang frees the sliding pool's slots of tokens that left the window (they
  translate to its padding slot 0, which the kernels may read but mask). So each step
  gets a second metadata, `swa_forward_metadata`, with the block table and slot mapping
  translated once; every layer that `layers_mapping` marks sliding attends with it.

Hybrid models (Gated DeltaNet + attention, e.g. Qwen3-Next): SGLang gives each request a
row of its mamba pool (`HybridReqToTokenPool`: `req_pool_indices` -> mamba indices) and
keeps every linear layer's conv and recurrent states there. The backend adds each step's
`state_metadata`: the step's metadata with those rows as `state_slots` and
`has_initial_state` from the tokens computed before the step
(`atom.hosts.state.with_state_slots`), which `atom_sglang.state_layer` hands the layers.

An fp8 pool (`--kv-cache-dtype fp8_e4m3`, stored as uint8, read as float8_e4m3fn) is
ATOM's fp8 cache: the kernels quantize on write and dequantize on read with each layer's
per-tensor `k_scale_float` / `v_scale_float` (SGLang's names on `RadixAttention`; None
is 1.0); an MLA pool's latent rows use `k_scale_float`.

CUDA graphs (decode): `init_cuda_graph_state` allocates static metadata buffers (with a
hybrid SWA pool, translated copies of the block table and slot mapping too);
`init_forward_metadata_out_graph` refills them from the (padded) batch before capture
and before every replay, so the captured kernels read the same addresses each time. The
metadata objects over them are built once per captured batch size.
It serves SGLang's own models as well as ATOM's (any `RadixAttention` caller).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from atom.forward_context import AttentionMetadata
from atom.hosts.state import with_state_slots
from atom.hosts.token_table import (
    block_table_from_token_table,
    metadata_from_token_table,
    paged_view,
)
from atom.kernels import mla_decode_attention, paged_attention, write_mla_cache
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE, fp8_kv_cache_unsupported
from atom.kernels.policy import selected_backend
from atom.layers.attention_spec import AttentionSpec
from atom.layers.mla_impl import NativeMLAImpl
from atom.layers.paged_attention_impl import PagedKVCache, write_kv_and_attend

BACKEND_NAME = "atom"
logger = logging.getLogger("sglang.atom_sglang.backend")


def atom_sliding_window(sglang_window: int | None) -> int | None:
    """SGLang's `sliding_window_size` w lets a query see keys q-w..q (w + 1 keys);
    ATOM's window counts the keys it sees. -1 / None: no window."""
    if sglang_window is None or sglang_window < 0:
        return None
    return sglang_window + 1


def radix_attention_spec(layer: Any, sinks: torch.Tensor | None) -> AttentionSpec:
    """The spec of one of SGLang's own `RadixAttention` layers (the backend serves SGLang's
    models too): its shape and settings in ATOM's terms."""
    return AttentionSpec(
        layer_name=f"layer {layer.layer_id}",
        num_heads=layer.tp_q_head_num,
        num_kv_heads=layer.tp_k_head_num,
        head_dim=layer.qk_head_dim,
        v_head_dim=layer.v_head_dim,
        scale=layer.scaling,
        sliding_window=atom_sliding_window(layer.sliding_window_size),
        logits_soft_cap=layer.logit_cap or None,
        sinks=sinks,
    )


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


def translated_metadata(
    metadata: AttentionMetadata,
    translate_slots: Callable[[torch.Tensor], torch.Tensor],
    page_size: int,
) -> AttentionMetadata:
    """`metadata` over the sliding-window pool: the same sequences and bounds, its block
    table and slot mapping translated (padding -1 stays -1: SGLang's translation
    table ends with a -1 sentinel)."""
    return dataclasses.replace(
        metadata,
        block_table=translate_pages(metadata.block_table, translate_slots, page_size),
        slot_mapping=translate_slots(metadata.slot_mapping),
    )


def sub_pools(pool: Any) -> tuple[Any, ...]:
    """The pools that hold the layers' KV: a hybrid SWA pool's full and sliding pools."""
    return (pool.full_kv_pool, pool.swa_kv_pool) if isinstance(pool, SWAKVPool) else (pool,)


def check_pool_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Raises where ATOM's kernels cannot read a pool of `dtype`."""
    if not dtype.is_floating_point or dtype.itemsize > 1:
        return
    if dtype != FP8_KV_CACHE_DTYPE:
        raise NotImplementedError(
            f"ATOM's attention backend has no {dtype} KV cache; use --kv-cache-dtype fp8_e4m3"
        )
    problem = fp8_kv_cache_unsupported(device)
    if problem:
        raise NotImplementedError(problem)


class AtomAttnBackend(AttentionBackend):
    """SGLang `AttentionBackend` running ATOM's schema and kernels."""

    def __init__(self, model_runner: Any):
        super().__init__()
        self.device = torch.device(model_runner.device)
        # SGLang's forward context reads the two pools from the active backend.
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        pools = sub_pools(self.token_to_kv_pool)
        self.is_mla = hasattr(pools[0], "kv_lora_rank")
        if self.is_mla and len(pools) > 1:
            raise NotImplementedError("ATOM's attention backend has no hybrid SWA MLA pool")
        if not self.is_mla and any(getattr(p, "use_hnd", False) for p in pools):
            raise NotImplementedError("ATOM's attention backend reads the NHD KV layout")
        if any(getattr(p, "is_quantized_kv_cache", False) for p in pools):
            raise NotImplementedError("ATOM's attention backend has no quantized KV cache")
        check_pool_dtype(pools[0].dtype, self.device)
        translator = getattr(model_runner, "kv_index_translator", None)
        if translator is not None and translator.is_translating:
            # req_to_token then holds virtual ids, which are no slots of the pool.
            raise NotImplementedError("ATOM's attention backend has no unified KV pool")
        # Hybrid SWA pool: the layers whose KV lives in the sliding-window pool.
        self.swa_pool: SWAKVPool | None = None
        self.swa_layers: frozenset[int] = frozenset()
        if isinstance(self.token_to_kv_pool, SWAKVPool):
            self.swa_pool = self.token_to_kv_pool
            mapping = self.swa_pool.layers_mapping
            self.swa_layers = frozenset(i for i, (_, is_swa) in mapping.items() if is_swa)
        self.max_context_len = self.req_to_token.shape[1]
        self.forward_metadata: AttentionMetadata | None = None
        self.swa_forward_metadata: AttentionMetadata | None = None  # hybrid SWA pool
        # Hybrid (mamba) pool: each request's state row, in `state_metadata`.
        self.has_state_pool = hasattr(self.req_to_token_pool, "get_mamba_indices")
        self.state_metadata: AttentionMetadata | None = None
        self.graph_buffers: dict[str, torch.Tensor] | None = None
        # By captured batch size: (full metadata, sliding-window metadata or None).
        self.graph_metadata: dict[int, tuple[AttentionMetadata, AttentionMetadata | None]] = {}
        self.num_calls = 0  # for tests and logs: proof that this backend ran
        hybrid = ""
        if self.swa_pool is not None:
            full = sorted(set(self.swa_pool.layers_mapping) - self.swa_layers)
            hybrid = f", hybrid SWA (full layers {full}, sliding layers {sorted(self.swa_layers)})"
        logger.info(
            "ATOM attention backend: %s pool%s, page size %d, KV %s, kernels: paged_attention=%s",
            "MLA" if self.is_mla else "MHA",
            hybrid,
            self.page_size,
            str(pools[0].dtype).removeprefix("torch."),
            selected_backend("paged_attention", self.device),
        )

    # ------------------------------------------------------------ per-forward metadata

    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = self.swa_forward_metadata = self.state_metadata = None
            return
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError("ATOM's attention backend has no speculative decoding")
        bs = forward_batch.batch_size
        if mode.is_decode():
            query_lens = torch.ones(bs, dtype=torch.int32, device=forward_batch.seq_lens.device)
            query_lens_cpu = torch.ones(bs, dtype=torch.int32)
        else:
            query_lens = forward_batch.extend_seq_lens
            query_lens_cpu = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int32)
        seq_lens_cpu = forward_batch.seq_lens_cpu
        self.forward_metadata = metadata_from_token_table(
            self.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            query_lens,
            forward_batch.out_cache_loc,
            self.page_size,
            seq_lens_cpu=seq_lens_cpu[:bs] if seq_lens_cpu is not None else None,
            query_lens_cpu=query_lens_cpu,
            all_decodes=mode.is_decode(),
        )
        if self.swa_pool is not None:
            self.swa_forward_metadata = translated_metadata(
                self.forward_metadata,
                self.swa_pool.translate_loc_from_full_to_swa,
                self.page_size,
            )
        if self.has_state_pool:
            rows = forward_batch.req_pool_indices[:bs]
            self.state_metadata = with_state_slots(
                self.forward_metadata,
                self.req_to_token_pool.get_mamba_indices(rows),
                forward_batch.seq_lens[:bs] - query_lens,
            )

    # ------------------------------------------------------------ CUDA graphs (decode)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
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

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padded rows: one key (slot 0, SGLang's padding slot)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        """Refills the static buffers from a padded decode batch (capture and replay)."""
        # No state rows for captured steps: ATOM's hybrid models refuse decode graphs
        # (atom_sglang.model); SGLang's own hybrids read their rows themselves.
        self.state_metadata = None
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
            swa_slots = buffers["swa_slot_mapping"][:bs]
            swa_slots.copy_(translate(buffers["slot_mapping"][:bs]))
            translate_pages(
                buffers["block_table"][:bs],
                translate,
                self.page_size,
                out=buffers["swa_block_table"][:bs],
            )
        self.forward_metadata, self.swa_forward_metadata = self._graph_metadata(bs)

    def _graph_metadata(self, bs: int) -> tuple[AttentionMetadata, AttentionMetadata | None]:
        """The metadata of the graph for `bs` requests (and its sliding-window twin with a
        hybrid SWA pool), built once (at capture) over the static buffers; replays only
        refill the buffers. Their bounds are graph-stable: the kernels' launch grids must
        not depend on the batch being replayed."""
        pair = self.graph_metadata.get(bs)
        if pair is None:
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
            )
            swa_metadata = None
            if self.swa_pool is not None:
                swa_metadata = dataclasses.replace(
                    metadata,
                    block_table=buffers["swa_block_table"][:bs],
                    slot_mapping=buffers["swa_slot_mapping"][:bs],
                )
            pair = self.graph_metadata[bs] = (metadata, swa_metadata)
        return pair

    # ------------------------------------------------------------ attention

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache, **kwargs)

    def _attend(self, q, k, v, layer, save_kv_cache: bool, spec=None, positions=None, sinks=None):
        """`spec` and `positions`: an ATOM layer's (`SglangAttention`), whose spec holds
        its window, soft cap, sinks and q/k rope (q and k arrive raw and rotate in the
        kernel that writes the cache). SGLang's own layers pass neither: their settings
        are the `RadixAttention`'s, and `sinks` their per-head attention-sink logits
        (GPT-OSS), as SGLang's backends take them."""
        metadata = self._step_metadata(layer.layer_id)
        if self.is_mla:
            return self._attend_mla(q, k, layer, metadata, save_kv_cache)
        if layer.logit_capping_method not in (None, "tanh"):
            raise NotImplementedError(f"logit capping {layer.logit_capping_method!r}")
        if spec is None:
            spec = radix_attention_spec(layer, sinks)
        cache = PagedKVCache(
            paged_view(self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.page_size),
            paged_view(self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.page_size),
            layer.k_scale_float or 1.0,
            layer.v_scale_float or 1.0,
        )
        n = metadata.num_tokens
        q_heads = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)[:n]
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        if save_kv_cache and k is not None:
            write_kv_and_attend(
                q_heads,
                k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)[:n],
                v.view(-1, layer.tp_v_head_num, layer.v_head_dim)[:n],
                cache,
                metadata,
                spec,
                positions[:n] if positions is not None else None,
                out=out[:n],
            )
        else:
            if spec.qk_rope is not None:
                raise ValueError("ATOM's backend rotates q/k only while writing the KV cache")
            paged_attention(
                q_heads, cache.key, cache.value, metadata, spec.scale,
                sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
                sinks=spec.sinks, out=out[:n], k_scale=cache.k_scale, v_scale=cache.v_scale,
            )  # fmt: skip
        return out.view(q.shape[0], -1)

    def _step_metadata(self, layer_id: int) -> AttentionMetadata:
        """This step's metadata in the index space of the pool that holds `layer_id`."""
        if layer_id in self.swa_layers:
            metadata = self.swa_forward_metadata
        else:
            metadata = self.forward_metadata
        if metadata is None:
            raise RuntimeError("ATOM attention backend: no metadata for this forward")
        self.num_calls += 1
        if self.num_calls == 1:
            logger.info("ATOM attention backend: first attention call (layer %d)", layer_id)
        return metadata

    def mla_cache(self, layer_id: int) -> torch.Tensor:
        """Layer `layer_id`'s latent rows as ATOM's MLA cache `[pages, page, L + R]`."""
        rows = self.token_to_kv_pool.get_key_buffer(layer_id)  # [slots, 1, L + R]
        return paged_view(rows.squeeze(1), self.page_size)

    def run_mla_impl(self, layer_id: int, impl: NativeMLAImpl, *inputs) -> torch.Tensor:
        """ATOM's MLA step (`impl`: latent cache write, absorbed decode, up-projected
        prefill) for an ATOM MLA layer, over its rows of SGLang's pool."""
        metadata = self._step_metadata(layer_id)
        return impl.attend(*inputs, self.mla_cache(layer_id), metadata)

    def _attend_mla(self, q, k, layer, metadata, save_kv_cache: bool) -> torch.Tensor:
        """SGLang's absorbed MLA call (its own DeepSeek models): q [T, H, L + R],
        k [T, 1, L + R] (latent + rope key) -> [T, H*L]. ATOM's MLA layers do not come
        here: they run ATOM's MLA step over `mla_cache` themselves."""
        latent_dim = layer.v_head_dim
        kv_cache = self.mla_cache(layer.layer_id)
        kv_scale = layer.k_scale_float or 1.0
        num_tokens = metadata.num_tokens
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if save_kv_cache and k is not None:
            k = k.view(-1, layer.qk_head_dim)[:num_tokens]
            write_mla_cache(
                k[:, :latent_dim], k[:, latent_dim:], kv_cache, metadata.slot_mapping,
                kv_scale=kv_scale,
            )  # fmt: skip
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, latent_dim)
        if metadata.num_decodes == metadata.num_seqs:
            mla_decode_attention(
                q[:num_tokens, :, :latent_dim],
                q[:num_tokens, :, latent_dim:],
                kv_cache,
                metadata,
                layer.scaling,
                out=out[:num_tokens],
                kv_scale=kv_scale,
            )
        else:  # the same latent-space MQA for every new token of an extend step
            keys = kv_cache.unsqueeze(2)
            paged_attention(
                q[:num_tokens], keys, keys[..., :latent_dim], metadata, layer.scaling,
                out=out[:num_tokens], k_scale=kv_scale, v_scale=kv_scale,
            )  # fmt: skip
        return out.view(q.shape[0], -1)


def create_atom_backend(model_runner: Any) -> AtomAttnBackend:
    """The factory SGLang's attention-backend registry calls (one per model runner)."""
    return AtomAttnBackend(model_runner)
