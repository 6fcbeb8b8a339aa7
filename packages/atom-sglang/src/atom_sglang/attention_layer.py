"""The impls ATOM's attention layers get inside SGLang, over SGLang's KV pool.

The wrapper builds the ATOM model inside `atom.layers.attention.attention_backend(
factory)`. Each ATOM attention layer gets an impl that owns an SGLang `RadixAttention`
(numbered like SGLang's own layers, so SGLang sizes its pools and sliding-window
bookkeeping for it), and that the wrapper binds to SGLang's KV pool and to its KV-cache
group (`bind_kv_pool`) the first time ATOM's backend runs a step.

Under ATOM's backend (`attention_backend="atom"`) the wrapper puts the step's one
complete `AttentionMetadata` into ATOM's forward context, and the impl runs ATOM's step
over its layer's buffers in the pool, reading only that metadata:

* MHA: `forward(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv], positions) -> [T,Hq,Dv]`, q and k
  raw: `write_kv_and_attend` with the layer's spec (one kernel applies the spec's q/k
  norm + rotary and writes the cache).
* MLA (DeepSeek): `forward(q_nope, q_pe, kv_c, k_pe) -> [T,H,Dv]`: ATOM's MLA step
  (`atom.layers.mla_impl.NativeMLAImpl.attend`, as natively and in vLLM: latent cache
  write, absorbed decode, up-projected prefill). A DeepSeek Sparse Attention layer also
  runs `select_tokens` (indexer key write + top-k) and `attend_selected` (MLA over the
  selected slots): its indexer keys sit in the same pool rows, after latent and rope
  (the rows are that wide: `atom_sglang.patches`, change 10), and the impl gets the
  row's column views each step.

* DeepSeek-V4 (spec.kind "compressed"): `forward(q, kv, compressor_rows, indexer)`,
  ATOM's `CompressedAttentionImpl` over the layer's rows of SGLang's MLA pool, each row
  wide enough for one page of every tensor the impl keeps (`atom.hosts.packed_pages`;
  the pool is that wide: `atom_sglang.patches`, change 12); the impl gets its views of
  the pages each step.

Under another backend (SGLang's own) the metadata is not ATOM's to build: the wrapper
puts the step's `HostAttention` into ATOM's forward context instead (SGLang's backend with
the step's batch bound in, `atom_sglang.model`), and the impl hands it its
`RadixAttention`: MHA with q/k normalised and rotated first; MLA through
`NativeMLAImpl.attend_through` (W_UK / W_UV absorption around SGLang's latent attention).
Either way the impl reads the step only from ATOM's forward context.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from torch import nn

from atom.forward_context import (
    AttentionMetadata,
    ForwardContext,
    HostAttention,
    get_forward_context,
)
from atom.hosts.packed_pages import unpack_pages
from atom.layers.attention_spec import AttentionSpec, ImplFactory
from atom.layers.compressed_attention_impl import (
    CompressedAttentionImpl,
    CompressedAttentionSpec,
    IndexerInputs,
)
from atom.layers.mla_impl import NativeMLAImpl
from atom.layers.paged_attention_impl import write_kv_and_attend
from atom_sglang.adapters import SglangAdapter
from atom_sglang.backend import mha_cache, mla_cache

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """SGLang's layer id (its KV pool's index) from ATOM's name `...layers.N.<...>`."""
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(match.group(1))


def step_metadata(context: ForwardContext, kv_group: int) -> AttentionMetadata:
    """The step's metadata as a layer of KV-cache group `kv_group` reads it."""
    if context.attn_metadata is None:
        raise RuntimeError(
            "ATOM attention in SGLang needs the step's metadata (ATOM's backend) or SGLang's "
            "backend for it (run the model through atom_sglang.model.AtomForCausalLM.forward)"
        )
    return context.attn_metadata.for_kv_group(kv_group)


class PoolBinding:
    """Where an impl's layer keeps its KV: SGLang's pool (read per step through the pool's
    own getters, which wait for a layer-wise KV load where one runs), its page size, and
    the layer's KV-cache group in the step's metadata."""

    def __init__(self, layer_name: str):
        self.layer_name = layer_name
        self.kv_pool: Any = None
        self.page_size = 1
        self.kv_group = 0

    def bind_kv_pool(self, kv_pool: Any, page_size: int, kv_group: int) -> None:
        self.kv_pool, self.page_size, self.kv_group = kv_pool, page_size, kv_group

    def pool(self) -> Any:
        if self.kv_pool is None:
            raise RuntimeError(f"{self.layer_name}: not bound to SGLang's KV pool yet")
        return self.kv_pool


class SglangAttention(nn.Module, PoolBinding):
    """ATOM's `AttentionImpl` in SGLang."""

    def __init__(self, spec: AttentionSpec):
        nn.Module.__init__(self)
        PoolBinding.__init__(self, spec.layer_name)
        self.spec = spec
        window = spec.sliding_window
        self.attn = RadixAttention(
            spec.num_heads,
            spec.head_dim,
            spec.scale,
            num_kv_heads=spec.num_kv_heads,
            layer_id=layer_index(spec.layer_name),
            logit_cap=spec.logits_soft_cap or 0.0,
            v_head_dim=spec.v_head_dim,
            sliding_window_size=window - 1 if window is not None else -1,
            prefix=spec.layer_name,
        )

    # A checkpoint's fp8 KV-cache scales (atom.loader.take_kv_scales) go where SGLang's
    # backends read them, its RadixAttention's `k_scale_float` / `v_scale_float`.
    @property
    def k_scale(self) -> float:
        return self.attn.k_scale_float or 1.0

    @k_scale.setter
    def k_scale(self, value: float) -> None:
        self.attn.k_scale_float = value

    @property
    def v_scale(self) -> float:
        return self.attn.v_scale_float or 1.0

    @v_scale.setter
    def v_scale(self, value: float) -> None:
        self.attn.v_scale_float = value

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        spec = self.spec
        context = get_forward_context()
        if context.host_attention is not None:
            return self._sglang_backend(q, k, v, positions, context.host_attention)
        metadata = step_metadata(context, self.kv_group)
        cache = mha_cache(
            self.pool(), self.attn.layer_id, self.page_size, self.k_scale, self.v_scale
        )
        n = metadata.num_tokens
        out = q.new_empty(q.shape[0], spec.num_heads, spec.v_head_dim)
        write_kv_and_attend(
            q[:n], k[:n], v[:n], cache, metadata, spec,
            positions[:n] if positions is not None else None, out=out[:n],
        )  # fmt: skip
        return out

    def _sglang_backend(self, q, k, v, positions, host_attention: HostAttention) -> torch.Tensor:
        spec = self.spec
        extra = {} if spec.sinks is None else {"sinks": spec.sinks}
        if spec.qk_rope is not None:  # SGLang's kernels take final q/k
            q, k = spec.qk_rope(positions, q, k)
        out = host_attention(self.attn, q.reshape(q.shape[0], -1), k, v, **extra)
        return out.view(-1, spec.num_heads, spec.v_head_dim)


class _SplitAbsorptionWeights:
    """SGLang's loader calls `quant_method.process_weights_after_loading(module)` on every
    module that has one, in module order, after `load_weights`; the MLA layer is built
    after its kv_b_proj, so W_UK / W_UV are split from kv_b_proj's final weights."""

    @staticmethod
    def process_weights_after_loading(layer: SglangMLAAttention) -> None:
        layer.impl.process_weights_after_loading()


class SglangMLAAttention(nn.Module, PoolBinding):
    """ATOM's `MLAImpl` in SGLang: `NativeMLAImpl` over SGLang's MLA pool or backend."""

    quant_method = _SplitAbsorptionWeights()

    def __init__(self, spec: AttentionSpec):
        nn.Module.__init__(self)
        PoolBinding.__init__(self, spec.layer_name)
        self.spec = spec
        self.latent_dim = spec.kv_lora_rank
        self.attn = RadixAttention(
            spec.num_heads,
            spec.kv_lora_rank + spec.qk_rope_head_dim,
            spec.scale,
            num_kv_heads=1,
            layer_id=layer_index(spec.layer_name),
            v_head_dim=spec.kv_lora_rank,
            prefix=spec.layer_name,
        )
        self.impl = NativeMLAImpl(spec)
        # The widths of the impl's cache tensors (latents, indexer keys) in one pool row.
        self.row_widths = [shape[-1] for shape in self.impl.kv_cache_shapes(1, 1)]

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        context = get_forward_context()
        host_attention = context.host_attention
        if host_attention is not None:

            def sglang_latent_attention(q, k, v):
                out = host_attention(self.attn, q.flatten(1), k, v)
                return out.view(-1, self.spec.num_heads, self.latent_dim)

            return self.impl.attend_through(q_nope, q_pe, kv_c, k_pe, sglang_latent_attention)
        metadata = step_metadata(context, self.kv_group)
        (kv_cache, *_) = self._bind_step_caches()
        return self.impl.attend(q_nope, q_pe, kv_c, k_pe, kv_cache, metadata)

    def select_tokens(self, index: Any) -> torch.Tensor:
        self._bind_step_caches()
        return self.impl.select_tokens(index)

    def attend_selected(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        topk_slots: torch.Tensor,
    ) -> torch.Tensor:
        self._bind_step_caches()  # a layer reusing another's selection did not select
        return self.impl.attend_selected(q_nope, q_pe, kv_c, k_pe, topk_slots)

    def _bind_step_caches(self) -> list[torch.Tensor]:
        """This layer's pool rows as the impl's caches (latents, then indexer keys), bound
        to the impl for this step (the pool's getter may wait for a layer-wise load)."""
        if get_forward_context().host_attention is not None and self.spec.index_topk:
            raise NotImplementedError(
                f"{self.layer_name}: ATOM's sparse attention in SGLang runs on ATOM's "
                "attention backend (attention_backend='atom')"
            )
        rows = mla_cache(self.pool(), self.attn.layer_id, self.page_size)
        needed = sum(self.row_widths)
        if rows.shape[-1] < needed:
            raise RuntimeError(
                f"{self.layer_name}: SGLang's MLA pool rows hold {rows.shape[-1]} channels, "
                f"ATOM's layer keeps {needed} ({self.row_widths}: latents, indexer keys)"
            )
        caches = list(rows[..., :needed].split(self.row_widths, dim=-1))
        self.impl.bind_kv_cache(caches, self.kv_group)
        return caches


class SglangCompressedAttention(nn.Module, PoolBinding):
    """ATOM's DeepSeek-V4 attention in SGLang: `CompressedAttentionImpl` over the layer's
    packed rows of SGLang's MLA pool, on ATOM's attention backend only (SGLang's own
    backends know nothing of compressed entries)."""

    def __init__(self, spec: CompressedAttentionSpec):
        nn.Module.__init__(self)
        PoolBinding.__init__(self, spec.layer_name)
        self.spec = spec
        # For SGLang's layer numbering and the wrapper's pool binding; never called.
        self.attn = RadixAttention(
            spec.num_heads,
            spec.head_dim,
            spec.scale,
            num_kv_heads=1,
            layer_id=layer_index(spec.layer_name),
            prefix=spec.layer_name,
        )
        self.impl = CompressedAttentionImpl(spec)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        compressor_rows: torch.Tensor | None = None,
        indexer: IndexerInputs | None = None,
    ) -> torch.Tensor:
        context = get_forward_context()
        if context.host_attention is not None:
            raise NotImplementedError(
                f"{self.layer_name}: ATOM's DeepSeek-V4 attention in SGLang runs on ATOM's "
                "attention backend (attention_backend='atom')"
            )
        step_metadata(context, self.kv_group)  # says so when the step has none
        rows = mla_cache(self.pool(), self.attn.layer_id, self.page_size)
        self.impl.bind_kv_cache(unpack_pages(rows, self.impl), self.kv_group)
        return self.impl(q, kv, compressor_rows, indexer)


LAYER_FOR_ATTENTION = {
    "MHA": SglangAttention,
    "MLA": SglangMLAAttention,
    "compressed": SglangCompressedAttention,
}


def sglang_attention_factory(adapter: SglangAdapter) -> ImplFactory:
    """The factory `attention_backend(...)` takes for a model of `adapter`'s family."""
    layer_cls = LAYER_FOR_ATTENTION[adapter.attention]

    def factory(spec: AttentionSpec) -> nn.Module:
        if spec.kind != adapter.attention:
            raise ValueError(
                f"{spec.layer_name}: a {spec.kind} layer in a family adapted as {adapter.attention}"
            )
        return layer_cls(spec)

    return factory
