"""The part ATOM's MLA and DeepSeek-V4 layers share in vLLM: one cache row per token.

vLLM's own `MLAAttention` layer cannot host a foreign impl (see `attention_layer`), so
ATOM's MLA and compressed-attention impls each sit in a small layer of vLLM's
`AttentionLayerBase` kind. Both declare their cache the same way: an `MLAAttentionSpec`
(one "head", no separate V) whose row packs every tensor of the impl, so vLLM counts the
whole row in its page size, addresses it by the request's block table and slot mapping,
shares it on prefix hits and frees it with the request. The subclasses say how a row
splits into the impl's tensors (`bind_kv_cache`) and how the impl is called (`forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from atom.forward_context import get_forward_context
from atom.layers.attention_spec import AttentionSpec
from atom_vllm.patches import register_layer


class VllmRowCacheLayer(nn.Module, AttentionLayerBase):
    """An ATOM impl (`impl.kv_group`, `impl.bind_kv_cache`) whose cache is `row_width`
    elements per token, registered in vLLM's static forward context under its layer name."""

    def __init__(self, spec: AttentionSpec, impl: nn.Module, row_width: int, vllm_config: Any):
        nn.Module.__init__(self)
        cache_config = vllm_config.cache_config
        self.spec = spec
        self.layer_name = spec.layer_name
        self.impl = impl
        self.row_width = row_width
        self.block_size = cache_config.block_size
        self.kv_cache_dtype = str(cache_config.cache_dtype)
        self.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(
            self.kv_cache_dtype, vllm_config.model_config
        )
        self.num_kv_heads = 1
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

    def get_kv_cache_spec(self, vllm_config: Any) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=1,
            head_size=self.row_width,
            dtype=self.kv_cache_torch_dtype,
            cache_dtype_str=self.kv_cache_dtype,
        )

    @staticmethod
    def profiling() -> bool:
        """vLLM's profiling and dummy runs carry no metadata (and run before the cache)."""
        return get_forward_context().attn_metadata is None
