"""Triton implementations, registered with the kernel policy when imported (CUDA and ROCm)."""

from atom.kernels.triton import (
    activation,
    causal_conv1d,
    compressed_attention,
    fp8,
    fused_moe,
    fused_moe_mxfp4,
    fused_qkv,
    gated_delta,
    gated_delta_gates,
    indexer,
    kv_cache,
    mla,  # noqa: F401  (registers the MLA kernels)
    moe_routing,
    norm,
    paged_attention,
    rotary,
    sparse_mla,
    w4a16,
    window_compression,
)

__all__ = [
    "activation",
    "causal_conv1d",
    "compressed_attention",
    "fp8",
    "fused_moe",
    "fused_moe_mxfp4",
    "fused_qkv",
    "gated_delta",
    "gated_delta_gates",
    "indexer",
    "kv_cache",
    "moe_routing",
    "norm",
    "paged_attention",
    "rotary",
    "sparse_mla",
    "w4a16",
    "window_compression",
]
