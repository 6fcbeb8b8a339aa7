"""q/k RMSNorm (optional) + rotary + KV-cache write, from the qkv projection in one pass.

Between a layer's qkv projection and paged attention the unfused path runs up to five
elementwise kernels (q norm, k norm, two rotations, the KV write) and copies q/k on the
way. This op reads q, k and v once, writes the rotated k and v into the cache, stores the
rotated k back into k (attention reads the step's new keys from there: contiguous rows,
no page lookups) and returns the rotated q. Its torch reference is the unfused sequence
of reference ops, so "correct" means exactly what the separate ops compute.
"""

from __future__ import annotations

import torch

from atom.kernels.kv_cache import write_kv_cache_torch
from atom.kernels.norm import rms_norm_torch
from atom.kernels.policy import dispatch, register
from atom.kernels.rotary import apply_rotary_emb_torch


@register("fused_qkv_rope_write_kv", "torch")
def fused_qkv_rope_write_kv_torch(
    q, k, v, positions, cos_sin_cache, rotary_dim, is_neox,
    key_cache, value_cache, slot_mapping, q_norm_weight, k_norm_weight, eps,
    k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    normed_k = k
    if q_norm_weight is not None:
        q, normed_k = rms_norm_torch(q, q_norm_weight, eps), rms_norm_torch(k, k_norm_weight, eps)
    q, rotated_k = apply_rotary_emb_torch(
        positions, q, normed_k, cos_sin_cache, rotary_dim, is_neox
    )
    num_slots = slot_mapping.shape[0]
    write_kv_cache_torch(
        rotated_k[:num_slots], v[:num_slots], key_cache, value_cache, slot_mapping, k_scale, v_scale
    )
    k.copy_(rotated_k)
    return q


def fused_qkv_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Returns q [T, Hq, D] ready for attention; writes k and v into the paged cache and
    leaves k (in place, every row) as written there: normalised and rotated.

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]: views of the fused qkv projection are
    fine (any token/head strides, unit channel stride). With norm weights [D], q and k
    get a per-head RMSNorm first (Qwen3). Rotary as `apply_rotary_emb` (first rotary_dim
    channels, neox or gptj pairs, `cos_sin_cache[positions]`). Caches are
    [num_blocks, block_size, Hkv, D|Dv] views with any strides (vLLM's interleaved K/V,
    SGLang's pools with block_size 1). slot_mapping [T'] with T' <= T: -1 and tokens past
    T' (a host's padding) are not written. k_scale / v_scale: an fp8 cache's per-tensor
    scales (atom.kernels.kv_cache); k itself keeps the unquantized rotated keys.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q and k are normalised together: give both norm weights or neither")
    return dispatch("fused_qkv_rope_write_kv", q.device)(
        q, k, v, positions, cos_sin_cache, rotary_dim, is_neox,
        key_cache, value_cache, slot_mapping, q_norm_weight, k_norm_weight, eps, k_scale, v_scale,
    )  # fmt: skip
