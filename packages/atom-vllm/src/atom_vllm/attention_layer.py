"""The impl module ATOM's attention layers get inside vLLM: vLLM's `Attention` layer.

The wrapper builds the ATOM model inside `atom.layers.attention.attention_backend(
factory)`; for every ATOM `Attention` the factory returns a `VllmAttention`, which owns
a vLLM `Attention` layer constructed with `AtomAttentionBackend`. vLLM therefore sees an
ordinary attention layer named after ATOM's layer (`model.layers.N.self_attn.attn`):
it sizes, allocates and binds its KV cache, builds the step metadata and calls the
backend's impl.

DeepSeek-V4's layers (spec.kind == "compressed") get
`atom_vllm.compressed_attention_layer.VllmCompressedAttention`, MLA layers (spec.kind ==
"MLA") `VllmMLAAttention`. vLLM's generic `MLAAttention` layer cannot host a foreign MLA impl: it splits a vLLM
`ColumnParallelLinear` kv_b_proj into W_UK/W_UV itself, requires a vLLM MLA prefill
backend and calls the impl's `forward_mha` / `forward_mqa` with its own metadata types;
and vLLM's CPU platform has no MLA backend ("MLA is not supported on CPU").
`VllmMLAAttention` is a small layer of vLLM's `AttentionLayerBase` kind
(`atom_vllm.row_cache_layer.VllmRowCacheLayer`) that

* registers itself in vLLM's static forward context under ATOM's layer name;
* declares an `MLAAttentionSpec` whose one row per token holds every cache tensor of
  ATOM's impl side by side: the latent (kv_lora_rank + rope dims) and, for a DeepSeek
  Sparse Attention layer, its indexer key (index_head_dim). vLLM allocates, binds and
  zeroes a `[num_blocks, 1, block_size, L + R (+ Di)]` cache, so the indexer keys are in
  the latents' pages: counted in vLLM's page size, addressed by the same block table and
  slot mapping (the indexer's selection is cache slots that sparse MLA reads as latent
  rows), shared by prefix hits and freed with the request. (vLLM's own DeepSeek-V3.2
  declares its indexer cache as a second layer of the same KV-cache group; one row keeps
  ATOM's layer one vLLM layer, as it is natively.) `bind_kv_cache` hands the impl its
  column views of that row;
* names `AtomMLABackend`, whose builder is the MHA builder (same schema, decodes first);
* runs ATOM's own `NativeMLAImpl` (`layer.impl`): latent cache write, absorbed decode,
  up-projected prefill, and for sparse layers the indexer's key write + top-k and the
  MLA over the selected rows (`select_tokens`, `attend_selected`), with the step's
  metadata from ATOM's forward context (put there by the model wrapper, `atom_vllm.step`).

The impl's W_UK / W_UV split runs with ATOM's other post-load hooks, from the model
wrapper (`AtomForCausalLM._process_atom_weights`), in ATOM's module order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionBackend

from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE
from atom.layers.attention_spec import AttentionSpec, ImplFactory
from atom.layers.mla_impl import NativeMLAImpl
from atom_vllm.backend import (
    FP8_CACHE_DTYPES,
    AtomAttentionBackend,
    AtomMLABackend,
    cache_dtype_problem,
)
from atom_vllm.compressed_attention_layer import VllmCompressedAttention
from atom_vllm.patches import full_attention_in_a_windowed_model
from atom_vllm.row_cache_layer import VllmRowCacheLayer


class VllmAttention(nn.Module):
    """ATOM's `AttentionImpl` in vLLM: a vLLM `Attention` layer whose impl
    (`AtomAttentionImpl`) holds this layer's spec."""

    def __init__(self, spec: AttentionSpec, cache_config: Any):
        super().__init__()
        self.spec = spec
        # What vLLM itself needs: the cache shape, and the window, which decides the
        # pages its KV-cache manager keeps.
        self.attn = Attention(
            spec.num_heads,
            spec.head_dim,
            spec.scale,
            num_kv_heads=spec.num_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=spec.sliding_window,
            prefix=spec.layer_name,
            attn_backend=AtomAttentionBackend,
            head_size_v=spec.v_head_dim if spec.v_head_dim != spec.head_dim else None,
        )
        self.layer_name = spec.layer_name
        self.attn.impl.spec = spec
        if spec.sliding_window is None and self.attn.sliding_window is not None:
            full_attention_in_a_windowed_model(self.attn)

    @property
    def kv_group(self) -> int:
        return self.attn.impl.kv_group

    @kv_group.setter
    def kv_group(self, value: int) -> None:
        self.attn.impl.kv_group = value

    # The per-tensor fp8 KV-cache scales live on ATOM's impl: vLLM resets its own layer's
    # scales after loading when the checkpoint has no quantization config.
    @property
    def k_scale(self) -> float:
        return self.attn.impl.k_scale

    @k_scale.setter
    def k_scale(self, value: float) -> None:
        self.attn.impl.k_scale = value

    @property
    def v_scale(self) -> float:
        return self.attn.impl.v_scale

    @v_scale.setter
    def v_scale(self, value: float) -> None:
        self.attn.impl.v_scale = value

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        spec = self.spec
        # vLLM's op carries only q, k, v: the impl takes this step's positions from its
        # metadata (vLLM's CommonAttentionMetadata.positions), the same tensor as these.
        out = self.attn(q, k, v)
        return out.view(-1, spec.num_heads, spec.v_head_dim)

    def extra_repr(self) -> str:
        return f"layer={self.spec.layer_name!r}, backend=AtomAttentionBackend"


class VllmMLAAttention(VllmRowCacheLayer):
    """ATOM MLA impl contract: (q_nope, q_pe, kv_c, k_pe) -> [T, H, Dv]; for a sparse
    spec also `select_tokens` and `attend_selected` (the `SparseMLAImpl` protocol)."""

    def __init__(self, spec: AttentionSpec, vllm_config: Any):
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        problem = cache_dtype_problem(cache_dtype)
        if problem:
            raise NotImplementedError(f"ATOM's MLA attention does not support {problem}")
        impl = NativeMLAImpl(spec)  # ATOM's: kernels + W_UK/W_UV absorption
        # The widths of the impl's cache tensors (latents, indexer keys), one row in vLLM.
        row_widths = [shape[-1] for shape in impl.kv_cache_shapes(1, 1)]
        super().__init__(spec, impl, sum(row_widths), vllm_config)
        self.row_widths = row_widths
        self.num_heads = spec.num_heads
        # vLLM allocates an fp8 cache as uint8; ATOM's MLA kernels read float8_e4m3fn.
        self.fp8_cache = cache_dtype in FP8_CACHE_DTYPES

    def get_attn_backend(self) -> type[AttentionBackend]:
        return AtomMLABackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's `[num_blocks, 1, block_size, row]` cache -> the impl's tensors, each
        `[num_blocks, block_size, width]`: column views of the one "head" (ATOM's kernels
        read the block and token strides)."""
        self.kv_cache = kv_cache
        rows = kv_cache[:, 0]
        if self.fp8_cache:
            rows = rows.view(FP8_KV_CACHE_DTYPE)
        self.impl.bind_kv_cache(rows.split(self.row_widths, dim=-1), self.kv_group)

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        if self.profiling():
            return q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.spec.v_head_dim)
        self.num_calls += 1
        return self.impl(q_nope, q_pe, kv_c, k_pe)

    def select_tokens(self, index: Any) -> torch.Tensor:
        if self.profiling():
            return torch.full(
                (index.q.shape[0], self.spec.index_topk), -1, dtype=torch.int32,
                device=index.q.device,
            )  # fmt: skip
        return self.impl.select_tokens(index)

    def attend_selected(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        topk_slots: torch.Tensor,
    ) -> torch.Tensor:
        if self.profiling():
            return q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.spec.v_head_dim)
        self.num_calls += 1
        return self.impl.attend_selected(q_nope, q_pe, kv_c, k_pe, topk_slots)

    def extra_repr(self) -> str:
        return f"layer={self.layer_name!r}, backend=AtomMLABackend, impl=NativeMLAImpl"


def vllm_attention_factory(vllm_config: Any) -> ImplFactory:
    """The factory `attention_backend(...)` takes, for one vLLM model instance."""
    cache_config = vllm_config.cache_config

    def factory(spec: AttentionSpec) -> nn.Module:
        if spec.kind == "MLA":
            return VllmMLAAttention(spec, vllm_config)
        if spec.kind == "compressed":  # DeepSeek-V4
            return VllmCompressedAttention(spec, vllm_config)
        return VllmAttention(spec, cache_config)

    return factory
