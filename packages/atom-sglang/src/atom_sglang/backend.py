"""ATOM's attention backend for SGLang (`attention_backend="atom"`), MHA and MLA.

SGLang calls `init_forward_metadata(forward_batch)` once per forward; the backend's
builder (`atom_sglang.metadata`) turns the batch into the step's one complete
`atom.forward_context.AttentionMetadata` (docs/architecture.md), `step_metadata`. ATOM's
models run with it in ATOM's forward context (the model wrapper puts it there,
`atom_sglang.model`), and their layers (`atom_sglang.attention_layer`,
`atom_sglang.state_layer`) read only that. SGLang's pools, viewed as pages, are ATOM's
caches:

* MHA pool (`MHATokenToKVPool`, NHD layout): key/value `[slots, Hkv, D]` per layer
  -> `[slots / P, P, Hkv, D]`.
* MLA pool (`MLATokenToKVPool`): one latent row `[slots, 1, L + R]` per token, ATOM's
  MLA cache `[slots / P, P, L + R]`.
* Hybrid SWA pool (`SWAKVPool`): two MHA pools; sliding layers read the metadata's KV
  group 1 (the builder translates the tables).

An fp8 pool (`--kv-cache-dtype fp8_e4m3`, stored as uint8, read as float8_e4m3fn) is
ATOM's fp8 cache: the kernels quantize on write and dequantize on read with each layer's
per-tensor `k_scale_float` / `v_scale_float` (SGLang's names on `RadixAttention`; None
is 1.0); an MLA pool's latent rows use `k_scale_float`.

The backend also serves SGLang's own models (any `RadixAttention` caller):
`forward_extend` / `forward_decode` run ATOM's MHA step with the layer's settings, and
for SGLang's own MLA layers, which hand over weight-absorbed queries (q `[T, H, L + R]`,
values the first L channels), ATOM's latent attention (`atom.kernels.mla_latent_attention`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from atom.forward_context import AttentionMetadata
from atom.hosts.token_table import paged_view
from atom.kernels import PagedKVCache, mla_latent_attention, paged_attention, write_mla_cache
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE, fp8_kv_cache_unsupported
from atom.kernels.policy import selected_backend
from atom.layers.attention_spec import AttentionSpec
from atom.layers.paged_attention_impl import write_kv_and_attend
from atom_sglang.metadata import SglangMetadataBuilder

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


def mha_cache(
    pool: Any, layer_id: int, page_size: int, k_scale: float, v_scale: float
) -> PagedKVCache:
    """Layer `layer_id`'s key and value buffers in SGLang's pool as ATOM's paged cache
    (the pool's own getters: they wait for a layer-wise KV load where one runs)."""
    return PagedKVCache(
        paged_view(pool.get_key_buffer(layer_id), page_size),
        paged_view(pool.get_value_buffer(layer_id), page_size),
        k_scale,
        v_scale,
    )


def mla_cache(pool: Any, layer_id: int, page_size: int) -> torch.Tensor:
    """Layer `layer_id`'s latent rows `[slots, 1, L + R]` as ATOM's MLA cache
    `[pages, page, L + R]`."""
    return paged_view(pool.get_key_buffer(layer_id).squeeze(1), page_size)


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
        self.builder = SglangMetadataBuilder(model_runner, self.device)
        self.step_metadata: AttentionMetadata | None = None
        self.num_calls = 0  # for tests and logs: proof that this backend ran
        hybrid = ""
        if self.builder.swa_pool is not None:
            sliding = self.builder.sliding_layers
            full = sorted(set(self.builder.swa_pool.layers_mapping) - sliding)
            hybrid = f", hybrid SWA (full layers {full}, sliding layers {sorted(sliding)})"
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
        self.step_metadata = self.builder.build(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.builder.init_graph_buffers(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padded rows: one key (slot 0, SGLang's padding slot)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        """Refills the static buffers from a padded decode batch (capture and replay)."""
        self.step_metadata = self.builder.build_for_graph(forward_batch)

    def take_step(self, what: str) -> AttentionMetadata:
        """This forward's metadata, for `what` (a layer or a model) about to attend."""
        metadata = self.step_metadata
        if metadata is None:
            raise RuntimeError("ATOM attention backend: no metadata for this forward")
        self.num_calls += 1
        if self.num_calls == 1:
            logger.info("ATOM attention backend: first attention call (%s)", what)
        return metadata

    # ------------------------------------------------------------ SGLang's own layers

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, save_kv_cache, **kwargs)

    def _attend(self, q, k, v, layer, save_kv_cache: bool, sinks=None):
        """A `RadixAttention`'s call: its settings in ATOM's terms (`radix_attention_spec`;
        `sinks`, its per-head attention-sink logits, as SGLang's backends take them)."""
        metadata = self.take_step(f"layer {layer.layer_id}")
        metadata = metadata.for_kv_group(self.builder.kv_group(layer.layer_id))
        if self.is_mla:
            return self._attend_latent(q, k, layer, metadata, save_kv_cache)
        if layer.logit_capping_method not in (None, "tanh"):
            raise NotImplementedError(f"logit capping {layer.logit_capping_method!r}")
        spec = radix_attention_spec(layer, sinks)
        cache = mha_cache(
            self.token_to_kv_pool, layer.layer_id, self.page_size,
            layer.k_scale_float or 1.0, layer.v_scale_float or 1.0,
        )  # fmt: skip
        n = metadata.num_tokens
        q_heads = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)[:n]
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        if save_kv_cache and k is not None:
            k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)[:n]
            v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)[:n]
            write_kv_and_attend(q_heads, k, v, cache, metadata, spec, None, out=out[:n])
        else:
            paged_attention(q_heads, cache, metadata, spec.scoring, out=out[:n])
        return out.view(q.shape[0], -1)

    def _attend_latent(self, q, k, layer, metadata, save_kv_cache: bool) -> torch.Tensor:
        """SGLang's absorbed MLA call: q [T, H, L + R], k [T, 1, L + R] (latent + rope
        key) -> [T, H*L]."""
        latent_dim = layer.v_head_dim
        kv_cache = mla_cache(self.token_to_kv_pool, layer.layer_id, self.page_size)
        kv_scale = layer.k_scale_float or 1.0
        n = metadata.num_tokens
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if save_kv_cache and k is not None:
            k = k.view(-1, layer.qk_head_dim)[:n]
            write_mla_cache(
                k[:, :latent_dim], k[:, latent_dim:], kv_cache, metadata.slot_mapping,
                kv_scale=kv_scale,
            )  # fmt: skip
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, latent_dim)
        mla_latent_attention(
            q[:n], kv_cache, metadata, layer.scaling, latent_dim, out=out[:n], kv_scale=kv_scale
        )
        return out.view(q.shape[0], -1)


def atom_backend_of(backend: Any) -> AtomAttnBackend | None:
    """ATOM's backend behind SGLang's active one (itself, or the full-attention backend
    SGLang's hybrid linear-attention wrapper holds); None: SGLang's own runs the step."""
    backend = getattr(backend, "full_attn_backend", backend)
    return backend if isinstance(backend, AtomAttnBackend) else None


def create_atom_backend(model_runner: Any) -> AtomAttnBackend:
    """The factory SGLang's attention-backend registry calls (one per model runner)."""
    return AtomAttnBackend(model_runner)
