"""ATOM kernels: one module per op family; each op has a torch reference (see policy.py)."""

# Declares Triton and aiter to the kernel policy before any op dispatches.
from atom.kernels import backends  # noqa: F401
from atom.kernels.activation import silu_and_mul
from atom.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_scaled_mm,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)
from atom.kernels.fused_qkv import fused_qkv_rope_write_kv
from atom.kernels.indexer import indexer_topk, write_indexer_keys
from atom.kernels.kv_cache import write_kv_cache
from atom.kernels.mla import (
    absorb_query,
    expand_latent_output,
    mla_attention,
    mla_decode_attention,
    mla_latent_attention,
    mla_prefill_attention,
    write_mla_cache,
)
from atom.kernels.moe import fused_moe, grouped_topk, topk_softmax
from atom.kernels.norm import fused_add_rms_norm, gated_rms_norm, rms_norm, zero_centred_rms_norm
from atom.kernels.paged_attention import AttentionScoring, PagedKVCache, paged_attention
from atom.kernels.rotary import apply_rotary_emb, compute_cos_sin_cache
from atom.kernels.sparse_mla import sparse_mla, sparse_mla_attention

__all__ = [
    "FP8_DTYPE",
    "AttentionScoring",
    "PagedKVCache",
    "absorb_query",
    "apply_rotary_emb",
    "compute_cos_sin_cache",
    "dequantize_fp8",
    "expand_latent_output",
    "fp8_scaled_mm",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_qkv_rope_write_kv",
    "gated_rms_norm",
    "grouped_topk",
    "indexer_topk",
    "mla_attention",
    "mla_decode_attention",
    "mla_latent_attention",
    "mla_prefill_attention",
    "paged_attention",
    "quantize_fp8_per_block",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token",
    "quantize_fp8_per_token_group",
    "rms_norm",
    "silu_and_mul",
    "sparse_mla",
    "sparse_mla_attention",
    "topk_softmax",
    "write_indexer_keys",
    "write_kv_cache",
    "write_mla_cache",
    "zero_centred_rms_norm",
]
