"""Per-family needs of ATOM models in SGLang, declared here instead of branched on.

The wrapper (`atom_sglang.model`) reads one `SglangAdapter` per architecture family:

* `attention`: the ATOM impl contract the family's layers use ("MHA": forward(q, k, v);
  "MLA": forward(q_nope, q_pe, kv_c, k_pe)), which picks the SGLang layer built for it.
* `kv_pool`: the KV pool SGLang must allocate for it ("mha": per-layer key/value
  `[slots, Hkv, D]`; "mla": one latent row `[slots, 1, L + R]`, DeepSeek's compressed
  cache). SGLang decides the pool from the architecture name; the wrapper checks that
  its decision is this one before building anything.
* `fuse_qk_rope`: the family's q/k norm + rotary (`atom.layers.attention_spec.QKRope`:
  Qwen3's per-head RMSNorm, then rotary) runs in the kernel that writes the KV cache
  when ATOM's backend serves the layer (`atom_sglang.attention_layer.SglangAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.registry import ModelEntry


@dataclass(frozen=True)
class SglangAdapter:
    attention: str  # "MHA" | "MLA"
    kv_pool: str  # "mha" | "mla"
    fuse_qk_rope: bool = False


MHA_FUSED_ROPE = SglangAdapter(attention="MHA", kv_pool="mha", fuse_qk_rope=True)
MLA_LATENT = SglangAdapter(attention="MLA", kv_pool="mla")

_BY_FAMILY = {
    "Llama 2 / 3.x": MHA_FUSED_ROPE,
    "Qwen3": MHA_FUSED_ROPE,
    "Qwen3-MoE": MHA_FUSED_ROPE,
    "Mixtral": MHA_FUSED_ROPE,
    "DeepSeek-V2": MLA_LATENT,
    "DeepSeek-V3": MLA_LATENT,
}


class NoSglangAdapter(LookupError):
    pass


def adapter_for(entry: ModelEntry) -> SglangAdapter:
    try:
        adapter = _BY_FAMILY[entry.family]
    except KeyError:
        raise NoSglangAdapter(
            f"ATOM's {entry.architecture} ({entry.family}) has no SGLang adapter"
        ) from None
    if adapter.attention != entry.attention:
        raise NoSglangAdapter(
            f"SGLang adapter of {entry.family} is {adapter.attention}, "
            f"the registry says {entry.attention}"
        )
    return adapter


def has_adapter(entry: ModelEntry) -> bool:
    return entry.family in _BY_FAMILY
