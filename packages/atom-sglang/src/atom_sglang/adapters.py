"""What an ATOM model needs in SGLang, derived from `atom.registry` (no table of its own).

The wrapper (`atom_sglang.model`) reads one `SglangAdapter` per architecture, chosen by
the registry entry's attention kind:

* `attention`: the ATOM impl contract the family's layers use ("MHA": forward(q, k, v);
  "MLA": forward(q_nope, q_pe, kv_c, k_pe); "compressed", DeepSeek-V4: forward(q, kv,
  compressor_rows, indexer)), which picks the SGLang layer built for it.
* `kv_pool`: the KV pool SGLang must allocate for it ("mha": per-layer key/value
  `[slots, Hkv, D]`; "mla": one latent row `[slots, 1, L + R]`, DeepSeek's compressed
  cache; DeepSeek-V4's packed rows are such rows, atom_sglang.patches change 12).
  SGLang decides the pool from the architecture name; the wrapper checks that
  its decision is this one before building anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.registry import ModelEntry


@dataclass(frozen=True)
class SglangAdapter:
    attention: str  # "MHA" | "MLA" | "compressed"
    kv_pool: str  # "mha" | "mla"


BY_ATTENTION = {
    "MHA": SglangAdapter(attention="MHA", kv_pool="mha"),
    "MLA": SglangAdapter(attention="MLA", kv_pool="mla"),
    "compressed": SglangAdapter(attention="compressed", kv_pool="mla"),
}


class NoSglangAdapter(LookupError):
    pass


def adapter_for(entry: ModelEntry) -> SglangAdapter:
    try:
        return BY_ATTENTION[entry.attention]
    except KeyError:
        raise NoSglangAdapter(
            f"ATOM's {entry.architecture} uses {entry.attention} attention, which "
            f"atom-sglang has no SGLang layer for (it has: {', '.join(BY_ATTENTION)})"
        ) from None


def has_adapter(entry: ModelEntry) -> bool:
    return entry.attention in BY_ATTENTION
