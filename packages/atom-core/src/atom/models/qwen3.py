"""Qwen3: Llama with per-head RMSNorm on q and k."""

from __future__ import annotations

from atom.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_kwargs = {"qk_norm": True}
