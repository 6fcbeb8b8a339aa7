"""Rotary position embedding: cos/sin caches (default, linear, llama3, yarn) and rotation."""

from __future__ import annotations

import math
from typing import Any

import torch

from atom.kernels.policy import dispatch, register


def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rotary_dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    cos_sin_factor = scaling.get("attention_factor")
    if cos_sin_factor is None:
        if mscale and mscale_all_dim:
            cos_sin_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            cos_sin_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    inv_freq = 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp)
    return inv_freq, cos_sin_factor


def rope_inv_freq(
    rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], factor on cos and sin) of a rope type, for
    callers that turn positions into angles themselves (no cache of max_position rows)."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return _inv_freq(rotary_dim, base), 1.0
    if rope_type == "linear":
        return _inv_freq(rotary_dim, base) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_inv_freq(rotary_dim, base), scaling), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, scaling)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, yarn"
    )


def compute_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, float]:
    """Returns (cache [max_position, rotary_dim] = cos | sin, attention scale factor).

    The attention scale factor is what DeepSeek multiplies its softmax scale by under yarn
    (mscale_all_dim squared); it is 1.0 otherwise.
    """
    scaling = rope_scaling or {}
    inv_freq, cos_sin_factor = rope_inv_freq(rotary_dim, base, scaling)
    attention_scale = 1.0
    if scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("mscale_all_dim"):
        attention_scale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos() * cos_sin_factor, freqs.sin() * cos_sin_factor], dim=-1)
    return cache.to(dtype), attention_scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if is_neox:
        return torch.cat([out1, out2], dim=-1)
    return torch.stack([out1, out2], dim=-1).flatten(-2)


@register("apply_rotary_emb", "torch")
def apply_rotary_emb_torch(positions, query, key, cos_sin_cache, rotary_dim, is_neox):
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rotated = _rotate(x[..., :rotary_dim].float(), cos, sin, is_neox).to(x.dtype)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)

    return rotate(query), rotate(key)


def apply_rotary_emb(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first rotary_dim channels of query [T, Hq, D] and key [T, Hk, D].

    neox style pairs channel i with i + rotary_dim/2; gptj style pairs 2i with 2i+1.
    """
    return dispatch("apply_rotary_emb", query.device)(
        positions, query, key, cos_sin_cache, rotary_dim, is_neox
    )
