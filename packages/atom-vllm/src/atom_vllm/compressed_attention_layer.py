"""The vLLM layer around ATOM's DeepSeek-V4 attention impl (`CompressedAttentionImpl`).

vLLM's own DeepSeek-V4 keeps its compressed caches as extra layers and buffers of its
own kernels (AMX on CPU, block size 256); ATOM's impl keeps, per layer and page, the
K = V rows and compressor projections of every token and the compressed entries of the
windows the page's tokens close (docs/architecture.md, "DeepSeek-V4"). `VllmCompressedAttention`
makes that one vLLM layer, as `VllmMLAAttention` does for MLA:

* it registers itself in vLLM's static forward context under ATOM's layer name;
* it declares an `MLAAttentionSpec` (one tensor per token, no separate V) whose row holds
  one page of every cache tensor of the impl per `block_size` rows
  (`atom.hosts.packed_pages.packed_row_width`): vLLM counts it in its page size, addresses
  it by the request's block table and slot mapping, shares it on prefix hits and frees it
  with the request. The layers' rows differ in width (a sliding-only layer keeps only
  K = V), so vLLM puts them in one group of `UniformTypeKVCacheSpecs`, each its own
  tensor: every layer keeps every page, the full layout the native engine also uses;
* `bind_kv_cache` hands the impl its views of that page (`unpack_pages`);
* `forward` runs the impl, which reads the step from ATOM's forward context
  (`atom_vllm.step.StepBridge`), or returns zeros in vLLM's profiling and dummy runs,
  which carry no metadata.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionBackend, AttentionType
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from atom.forward_context import get_forward_context
from atom.hosts.packed_pages import packed_row_width, unpack_pages
from atom.layers.compressed_attention_impl import (
    CompressedAttentionImpl,
    CompressedAttentionSpec,
    IndexerInputs,
)
from atom_vllm.backend import PLAIN_CACHE_DTYPES, AtomCompressedBackend
from atom_vllm.patches import register_layer


class VllmCompressedAttention(nn.Module, AttentionLayerBase):
    """ATOM's DeepSeek-V4 attention in vLLM: (q, kv, compressor rows, indexer inputs) ->
    [T, H, D], as `CompressedAttentionImpl.forward`."""

    def __init__(self, spec: CompressedAttentionSpec, vllm_config: Any):
        nn.Module.__init__(self)
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in PLAIN_CACHE_DTYPES:
            # The rows hold compressor projections that are softmax-weighted later.
            raise NotImplementedError(
                f"ATOM's DeepSeek-V4 attention does not support kv_cache_dtype={cache_dtype!r} "
                "(its cache keeps compressor projections; supported: auto)"
            )
        self.spec = spec
        self.layer_name = spec.layer_name
        self.impl = CompressedAttentionImpl(spec)
        self.block_size = vllm_config.cache_config.block_size
        self.row_width = packed_row_width(self.impl, self.block_size)
        self.kv_cache_dtype = cache_dtype
        self.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(
            cache_dtype, vllm_config.model_config
        )
        self.attn_type = AttentionType.DECODER
        self.kv_cache = torch.tensor([])  # bound by vLLM (bind_kv_cache)
        self.num_calls = 0
        register_layer(vllm_config, self.layer_name, self)

    @property
    def kv_group(self) -> int:
        return self.impl.kv_group

    @kv_group.setter
    def kv_group(self, value: int) -> None:  # set by atom_vllm.step
        self.impl.kv_group = value

    def get_attn_backend(self) -> type[AttentionBackend]:
        return AtomCompressedBackend

    def get_kv_cache_spec(self, vllm_config: Any) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=1,
            head_size=self.row_width,
            dtype=self.kv_cache_torch_dtype,
            cache_dtype_str=self.kv_cache_dtype,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's `[num_blocks, 1, block_size, row]` cache -> the impl's tensors."""
        self.kv_cache = kv_cache
        self.impl.bind_kv_cache(unpack_pages(kv_cache[:, 0], self.impl), self.kv_group)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        compressor_rows: torch.Tensor | None = None,
        indexer: IndexerInputs | None = None,
    ) -> torch.Tensor:
        # vLLM's profiling and dummy runs carry no metadata (and run before the cache).
        if get_forward_context().attn_metadata is None:
            return q.new_zeros(q.shape)
        self.num_calls += 1
        return self.impl(q, kv, compressor_rows, indexer)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_name!r}, backend=AtomCompressedBackend, "
            f"impl=CompressedAttentionImpl, row={self.row_width}"
        )
