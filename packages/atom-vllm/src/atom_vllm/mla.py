"""ATOM's MLA (DeepSeek-V2/V3) attention inside vLLM: a layer, a backend, the metadata.

vLLM's generic `MLAAttention` layer is not a host for a foreign MLA impl: it owns
the absorption itself (it splits a vLLM `ColumnParallelLinear` kv_b_proj into W_UK/W_UV),
requires a vLLM MLA prefill backend and calls the impl's `forward_mha` / `forward_mqa`
with its own metadata types. And its CPU platform has no MLA backend at all ("MLA is not
supported on CPU"). So ATOM's MLA layers get `VllmMLAAttention`, a small layer of
vLLM's `AttentionLayerBase` kind that

* registers itself in vLLM's static forward context under ATOM's layer name;
* declares an `MLAAttentionSpec` (one latent row of kv_lora_rank + rope dims per token),
  so vLLM allocates, binds and zeroes a `[num_blocks, 1, block_size, L + R]` cache whose
  one "head" is the `[num_blocks, block_size, L + R]` latent layout of ATOM's MLA kernels;
* names `AtomMLABackend`, whose builder is the MHA builder (same schema, decodes first);
* runs ATOM's own `NativeMLAImpl` (`layer.impl`): latent cache write, absorbed decode,
  up-projected prefill, with the step's `atom.forward_context.AttentionMetadata`.

The impl's W_UK / W_UV split runs with ATOM's other post-load hooks, from the model
wrapper (`AtomForCausalLM._process_atom_weights`), in ATOM's module order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.forward_context import get_forward_context as vllm_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionBackend, AttentionType
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from atom.forward_context import set_forward_context
from atom.layers.attention_spec import AttentionSpec
from atom.layers.mla_impl import NativeMLAImpl
from atom_vllm.attention import (
    PLAIN_CACHE_DTYPES,
    AtomAttentionMetadataBuilder,
    AtomBackendCapabilities,
)


class AtomMLAMetadataBuilder(AtomAttentionMetadataBuilder):
    """The MHA builder: MLA reads the same attention-metadata schema (docs/architecture.md)."""


class AtomMLABackend(AtomBackendCapabilities):
    """Capabilities of ATOM's MLA path; the layer runs ATOM's impl itself."""

    @staticmethod
    def get_impl_cls():
        # vLLM's AttentionImpl interface is not used: VllmMLAAttention runs ATOM's impl.
        raise NotImplementedError("ATOM's MLA layer runs atom.layers.mla_impl.NativeMLAImpl")

    @staticmethod
    def get_builder_cls() -> type[AtomMLAMetadataBuilder]:
        return AtomMLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True


def step_metadata(layer_name: str):
    """This layer's metadata in vLLM's forward context (None in profiling runs)."""
    metadata = vllm_forward_context().attn_metadata
    if isinstance(metadata, list):  # speculative decoding: [0] is the base model's
        metadata = metadata[0]
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    return metadata


class VllmMLAAttention(nn.Module, AttentionLayerBase):
    """ATOM MLA impl contract: (q_nope, q_pe, kv_c, k_pe) -> [T, H, Dv]."""

    def __init__(self, spec: AttentionSpec, vllm_config: Any):
        nn.Module.__init__(self)
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in PLAIN_CACHE_DTYPES:
            raise NotImplementedError(
                f"ATOM's MLA attention does not support kv_cache_dtype={cache_dtype!r}"
            )
        self.spec = spec
        self.layer_name = spec.layer_name
        self.num_heads = spec.num_heads
        self.num_kv_heads = 1
        self.head_size = spec.kv_lora_rank + spec.qk_rope_head_dim
        self.kv_cache_dtype = cache_dtype
        self.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(
            cache_dtype, vllm_config.model_config
        )
        self.attn_type = AttentionType.DECODER
        self.impl = NativeMLAImpl(spec)  # ATOM's: kernels + W_UK/W_UV absorption
        self.kv_cache = torch.tensor([])  # bound by vLLM (bind_kv_cache)
        self.num_calls = 0
        context = vllm_config.compilation_config.static_forward_context
        if self.layer_name in context:
            raise ValueError(f"Duplicate layer name: {self.layer_name}")
        context[self.layer_name] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return AtomMLABackend

    def get_kv_cache_spec(self, vllm_config: Any) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.head_size,
            dtype=self.kv_cache_torch_dtype,
            cache_dtype_str=self.kv_cache_dtype,
        )

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        metadata = step_metadata(self.layer_name)
        if metadata is None:  # profiling / dummy run: no cache, no metadata
            return q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.spec.v_head_dim)
        self.num_calls += 1
        # vLLM binds a [num_blocks, 1, block_size, L + R] view: one latent "head".
        self.impl.bind_kv_cache(self.kv_cache[:, 0])
        with set_forward_context(metadata):
            return self.impl(q_nope, q_pe, kv_c, k_pe)

    def extra_repr(self) -> str:
        return f"layer={self.layer_name!r}, backend=AtomMLABackend, impl=NativeMLAImpl"
