"""Rotary position embedding with a precomputed cos/sin cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.kernels import apply_rotary_emb, compute_cos_sin_cache
from atom.kernels.rotary import rope_inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        cache, self.attention_scale_factor = compute_cos_sin_cache(
            rotary_dim, max_position, rope_theta, rope_scaling
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq, D] and key [T, Hk, D], rotated in the first rotary_dim channels."""
        return apply_rotary_emb(
            positions, query, key, self.cos_sin_cache, self.rotary_dim, self.is_neox_style
        )


def get_rope(
    head_dim: int,
    max_position: int,
    rope_parameters: dict[str, Any],
    rotary_dim: int | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """A RotaryEmbedding from `atom.config.get_rope_parameters(hf_config)`."""
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    factor = (scaling or {}).get("factor", 1.0)
    original = (scaling or {}).get("original_max_position_embeddings")
    # yarn/linear caches must reach the scaled context, not only the original one.
    max_position = max(max_position, int(original * factor) if original else max_position)
    return RotaryEmbedding(
        head_dim,
        rotary_dim or head_dim,
        max_position,
        rope_parameters["rope_theta"],
        scaling,
        is_neox_style,
    )


class TrailingRotaryEmbedding(nn.Module):
    """Rotary on the last `rotary_dim` channels of each head, pairs (2i, 2i + 1)
    (DeepSeek-V4, whose heads are [nope | rope]). Angles come from the positions on the
    fly: V4 runs to a million positions, and a cos/sin cache of them per rope type would
    hold hundreds of MiB. `inverse` rotates back by the same angles (-sin), which V4 applies
    to the attention output: K = V there, so the values carry their keys' rotation."""

    def __init__(self, rotary_dim: int, rope_parameters: dict[str, Any]):
        super().__init__()
        self.rotary_dim = rotary_dim
        scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        inv_freq, self.cos_sin_factor = rope_inv_freq(
            rotary_dim, rope_parameters["rope_theta"], scaling
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """x [T, ..., D] rotated at positions [T] (fp32 math, x's dtype out)."""
        angles = positions.float()[:, None] * self.inv_freq.float()
        cos = (angles.cos() * self.cos_sin_factor).view(len(positions), *[1] * (x.dim() - 2), -1)
        sin = (angles.sin() * self.cos_sin_factor).view_as(cos)
        if inverse:
            sin = -sin
        head, tail = x[..., : -self.rotary_dim], x[..., -self.rotary_dim :].float()
        even, odd = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        return torch.cat([head, rotated.flatten(-2).to(x.dtype)], dim=-1)
