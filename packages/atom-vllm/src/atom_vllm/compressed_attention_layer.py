"""The vLLM layer around ATOM's DeepSeek-V4 attention impl (`CompressedAttentionImpl`).

vLLM's own DeepSeek-V4 keeps its compressed caches as extra layers and buffers of its
own kernels (AMX on CPU, block size 256); ATOM's impl keeps, per layer and page, the
K = V rows and compressor projections of every token and the compressed entries of the
windows the page's tokens close (docs/architecture.md, "DeepSeek-V4"). `VllmCompressedAttention`
makes that one vLLM layer, as `VllmMLAAttention` does for MLA (both on
`atom_vllm.row_cache_layer.VllmRowCacheLayer`):

* it registers itself in vLLM's static forward context under ATOM's layer name;
* it declares an `MLAAttentionSpec` (one tensor per token, no separate V) whose row holds
  one page of every cache tensor of the impl per `block_size` rows
  (`atom.hosts.packed_pages.packed_row_width`): vLLM counts it in its page size, addresses
  it by the request's block table and slot mapping, shares it on prefix hits and frees it
  with the request. The layers' rows differ in width (a sliding-only layer keeps only
  K = V), so vLLM puts them in one group of `UniformTypeKVCacheSpecs`, each its own
  tensor: every layer keeps every page (the native engine frees the rows' pages as the
  window passes, in a KV-cache group of their own: docs/architecture.md);
* `bind_kv_cache` hands the impl its views of that page (`unpack_pages`);
* `forward` runs the impl, which reads the step from ATOM's forward context
  (`atom_vllm.step.StepBridge`), or returns zeros in vLLM's profiling and dummy runs,
  which carry no metadata.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionBackend

from atom.hosts.packed_pages import packed_row_width, unpack_pages
from atom.layers.compressed_attention_impl import (
    CompressedAttentionImpl,
    CompressedAttentionSpec,
    IndexerInputs,
)
from atom_vllm.backend import PLAIN_CACHE_DTYPES, AtomCompressedBackend
from atom_vllm.row_cache_layer import VllmRowCacheLayer


class VllmCompressedAttention(VllmRowCacheLayer):
    """ATOM's DeepSeek-V4 attention in vLLM: (q, kv, compressor rows, indexer inputs) ->
    [T, H, D], as `CompressedAttentionImpl.forward`."""

    def __init__(self, spec: CompressedAttentionSpec, vllm_config: Any):
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in PLAIN_CACHE_DTYPES:
            # The rows hold compressor projections that are softmax-weighted later.
            raise NotImplementedError(
                f"ATOM's DeepSeek-V4 attention does not support kv_cache_dtype={cache_dtype!r} "
                "(its cache keeps compressor projections; supported: auto)"
            )
        impl = CompressedAttentionImpl(spec)
        row_width = packed_row_width(impl, vllm_config.cache_config.block_size)
        super().__init__(spec, impl, row_width, vllm_config)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return AtomCompressedBackend

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
        if self.profiling():
            return q.new_zeros(q.shape)
        self.num_calls += 1
        return self.impl(q, kv, compressor_rows, indexer)

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_name!r}, backend=AtomCompressedBackend, "
            f"impl=CompressedAttentionImpl, row={self.row_width}"
        )
