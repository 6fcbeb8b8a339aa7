"""The impl modules ATOM's attention layers get inside SGLang: `RadixAttention` owners.

The wrapper builds the ATOM model inside `atom.layers.attention.attention_backend(
factory)`. Each ATOM attention layer gets a module that owns an SGLang `RadixAttention`
(numbered like SGLang's own layers, so it indexes SGLang's KV pool) and calls it with
the step's `ForwardBatch`, which the wrapper puts in ATOM's forward context. Whatever
attention backend the engine runs (`"atom"`, or SGLang's own) does the paged-KV work.

* MHA: `forward(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv], positions) -> [T,Hq,Dv]`, q and k
  raw: under ATOM's backend the layer's spec and the positions travel with the call
  (`RadixAttention` hands extra keywords to the backend) and one kernel applies the
  spec's q/k norm + rotary and writes the cache; under another backend the layer applies
  them first.
* MLA (DeepSeek): `forward(q_nope, q_pe, kv_c, k_pe) -> [T,H,Dv]`. Under ATOM's backend
  the layer runs ATOM's MLA step (`atom.layers.mla_impl.NativeMLAImpl`, as natively and
  in vLLM: latent cache write, absorbed decode, up-projected prefill) over its layer's
  rows of SGLang's `MLATokenToKVPool`, with the step's metadata. Under another backend it
  calls SGLang's attention in SGLang's absorbed form: q_nope through W_UK into the latent
  space, the cached row is latent + rope key, the latent output goes through W_UV.
  Either way W_UK / W_UV are the impl's split of kv_b_proj.
"""

from __future__ import annotations

import re

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_context import get_attn_backend
from torch import nn

from atom.forward_context import get_forward_context
from atom.kernels import absorb_query, expand_latent_output
from atom.layers.attention_spec import AttentionSpec, ImplFactory
from atom.layers.mla_impl import NativeMLAImpl
from atom_sglang.adapters import SglangAdapter
from atom_sglang.backend import AtomAttnBackend

FORWARD_BATCH = "forward_batch"  # the key of SGLang's ForwardBatch in ATOM's context extras
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """SGLang's layer id (its KV pool's index) from ATOM's name `...layers.N.<...>`."""
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(match.group(1))


def current_forward_batch():
    batch = get_forward_context().extras.get(FORWARD_BATCH)
    if batch is None:
        raise RuntimeError(
            "ATOM attention in SGLang needs the step's ForwardBatch "
            "(run the model through atom_sglang.model.AtomForCausalLM.forward)"
        )
    return batch


class SglangAttention(nn.Module):
    """ATOM MHA impl contract over an SGLang `RadixAttention`."""

    def __init__(self, spec: AttentionSpec):
        super().__init__()
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
        if isinstance(get_attn_backend(), AtomAttnBackend):
            extra = {"spec": self.spec, "positions": positions}
        else:  # SGLang's backend: its kernels take final q/k
            extra = {} if self.spec.sinks is None else {"sinks": self.spec.sinks}
            if self.spec.qk_rope is not None:
                q, k = self.spec.qk_rope(positions, q, k)
        out = self.attn(q.reshape(q.shape[0], -1), k, v, current_forward_batch(), **extra)
        return out.view(-1, self.spec.num_heads, self.spec.v_head_dim)


class _SplitAbsorptionWeights:
    """SGLang's loader calls `quant_method.process_weights_after_loading(module)` on every
    module that has one, in module order, after `load_weights`; the MLA layer is built
    after its kv_b_proj, so W_UK / W_UV are split from kv_b_proj's final weights."""

    @staticmethod
    def process_weights_after_loading(layer: SglangMLAAttention) -> None:
        layer.impl.process_weights_after_loading()


class SglangMLAAttention(nn.Module):
    """ATOM MLA impl contract over SGLang's MLA pool and attention backends."""

    quant_method = _SplitAbsorptionWeights()

    def __init__(self, spec: AttentionSpec):
        super().__init__()
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

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        backend = get_attn_backend()
        if isinstance(backend, AtomAttnBackend):
            return backend.run_mla_impl(self.attn.layer_id, self.impl, q_nope, q_pe, kv_c, k_pe)
        w_uk, w_uv = self.impl.w_uk, self.impl.w_uv
        if w_uk is None:
            raise RuntimeError(f"{self.spec.layer_name}: W_UK/W_UV are not split yet")
        q = torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)
        k = torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1)
        out = self.attn(q.flatten(1), k, kv_c.unsqueeze(1), current_forward_batch())
        return expand_latent_output(out.view(-1, self.spec.num_heads, self.latent_dim), w_uv)


LAYER_FOR_ATTENTION = {"MHA": SglangAttention, "MLA": SglangMLAAttention}


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
