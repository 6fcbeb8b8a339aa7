"""Rotary references against HF: its rotary-embedding modules (built from real configs, so
`ROPE_INIT_FUNCTIONS` and the yarn attention factor come along) and its rotation functions."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    apply_rotary_emb as hf_v2_apply_rotary_emb,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from atom.kernels import apply_rotary_emb, compute_cos_sin_cache

BASE = 10000.0
MAX_POSITION = 512

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "linear-legacy-key": {"type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 0.8},
}  # fmt: skip

DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def hf_rope_parameters(scaling: dict | None) -> dict:
    params = dict(scaling or {"rope_type": "default"})
    params["rope_type"] = params.pop("type", params.get("rope_type"))
    return {"rope_theta": BASE, **params}


def llama_cos_sin(rotary_dim: int, scaling: dict | None, positions: torch.Tensor):
    config = LlamaConfig(
        hidden_size=2 * rotary_dim,
        num_attention_heads=2,
        head_dim=rotary_dim,
        max_position_embeddings=MAX_POSITION,
        rope_parameters=hf_rope_parameters(scaling),
    )
    return LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])


def deepseek_config(config_class, rope_dim: int, scaling: dict):
    return config_class(
        hidden_size=64, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=rope_dim, v_head_dim=32, num_hidden_layers=1,
        n_routed_experts=4, max_position_embeddings=MAX_POSITION,
        rope_parameters={"rope_theta": BASE, **scaling},
    )  # fmt: skip


def cache_as_hf(cache: torch.Tensor, positions: torch.Tensor):
    """HF's cos and sin are cat(freqs, freqs) per position; our cache holds one half of each."""
    cos, sin = cache[positions].chunk(2, dim=-1)
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


@pytest.mark.parametrize("name", list(ROPE_CASES))
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_cos_sin_cache_matches_hf(name, rotary_dim):
    cache, attention_scale = compute_cos_sin_cache(rotary_dim, MAX_POSITION, BASE, ROPE_CASES[name])
    assert cache.shape == (MAX_POSITION, rotary_dim) and cache.dtype == torch.float32
    positions = torch.arange(MAX_POSITION)
    want_cos, want_sin = llama_cos_sin(rotary_dim, ROPE_CASES[name], positions)
    got_cos, got_sin = cache_as_hf(cache, positions)
    torch.testing.assert_close(got_cos, want_cos[0])
    torch.testing.assert_close(got_sin, want_sin[0])
    assert attention_scale == 1.0


@pytest.mark.parametrize("mscale, mscale_all_dim", [(0.707, 0.707), (1.0, 0.5)])
def test_deepseek_yarn_matches_hf_v3_and_v2(mscale, mscale_all_dim):
    scaling = {**DEEPSEEK_YARN, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    rope_dim = 64
    cache, attention_scale = compute_cos_sin_cache(rope_dim, MAX_POSITION, BASE, scaling)
    positions = torch.arange(MAX_POSITION)
    config = deepseek_config(DeepseekV3Config, rope_dim, scaling)
    want_cos, want_sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    got_cos, got_sin = cache_as_hf(cache, positions)
    # cos/sin carry mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    torch.testing.assert_close(got_cos, want_cos[0])
    torch.testing.assert_close(got_sin, want_sin[0])

    # DeepSeek multiplies its softmax scale by mscale(factor, mscale_all_dim)^2.
    hf_attention = DeepseekV3Attention(config, layer_idx=0)
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    assert hf_attention.scaling / qk_head_dim**-0.5 == pytest.approx(attention_scale)
    assert attention_scale == pytest.approx((0.1 * mscale_all_dim * math.log(40.0) + 1.0) ** 2)

    v2_config = deepseek_config(DeepseekV2Config, rope_dim, scaling)
    freqs_cis = DeepseekV2RotaryEmbedding(v2_config)(torch.zeros(1), positions[None])[0]
    half = rope_dim // 2
    torch.testing.assert_close(cache[:, :half], freqs_cis.real)
    torch.testing.assert_close(cache[:, half:], freqs_cis.imag)


def test_cache_dtype_is_a_cast_of_the_fp32_cache():
    fp32, _ = compute_cos_sin_cache(32, 64, BASE, None)
    bf16, _ = compute_cos_sin_cache(32, 64, BASE, None, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.bfloat16())


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="'dynamic'"):
        compute_cos_sin_cache(64, 16, BASE, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'longrope'"):
        compute_cos_sin_cache(64, 16, BASE, {"type": "longrope"})


def random_qk(tokens: int, head_dim: int, dtype=torch.float32):
    return torch.randn(tokens, 4, head_dim, dtype=dtype), torch.randn(
        tokens, 2, head_dim, dtype=dtype
    )


@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (128, 64), (64, 32)])
def test_neox_matches_hf_llama(head_dim, rotary_dim):
    cache, _ = compute_cos_sin_cache(rotary_dim, MAX_POSITION, BASE, ROPE_CASES["llama3"])
    positions = torch.randint(0, MAX_POSITION, (9,))
    q, k = random_qk(9, head_dim)
    got_q, got_k = apply_rotary_emb(positions, q, k, cache, rotary_dim, True)
    # HF rotates [batch, heads, seq, dim]; channels past rotary_dim pass through unchanged.
    cos, sin = cache_as_hf(cache, positions)
    want_q, want_k = apply_rotary_pos_emb(
        q[..., :rotary_dim].transpose(0, 1)[None],
        k[..., :rotary_dim].transpose(0, 1)[None],
        cos[None],
        sin[None],
    )
    torch.testing.assert_close(got_q[..., :rotary_dim], want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k[..., :rotary_dim], want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(got_k[..., rotary_dim:], k[..., rotary_dim:])


def test_gptj_matches_hf_deepseek_v2_and_v3():
    rope_dim = 64
    cache, _ = compute_cos_sin_cache(rope_dim, MAX_POSITION, BASE, DEEPSEEK_YARN)
    positions = torch.randint(0, MAX_POSITION, (7,))
    q, k = random_qk(7, rope_dim)
    got_q, got_k = apply_rotary_emb(positions, q, k, cache, rope_dim, False)

    # V2 rotates interleaved pairs as complex numbers and keeps the interleaved layout.
    cos, sin = cache[positions].chunk(2, dim=-1)
    freqs_cis = torch.complex(cos, sin)[None]
    want_q, want_k = hf_v2_apply_rotary_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis
    )
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1))

    # V3's interleave variant rotates the same pairs but writes them back as halves.
    cos, sin = cache_as_hf(cache, positions)
    want_q, want_k = apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    to_halves = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    torch.testing.assert_close(got_q[..., to_halves], want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k[..., to_halves], want_k[0].transpose(0, 1))


def test_gptj_partial_rotary_follows_the_formula():
    head_dim, rotary_dim = 16, 8
    cache, _ = compute_cos_sin_cache(rotary_dim, 32, BASE, None)
    q = torch.randn(3, 1, head_dim)
    positions = torch.tensor([0, 5, 31])
    got, _ = apply_rotary_emb(positions, q, q.clone(), cache, rotary_dim, False)
    for t, p in enumerate(positions.tolist()):
        for i in range(rotary_dim // 2):
            angle = p / BASE ** (2 * i / rotary_dim)
            x1, x2 = q[t, 0, 2 * i].item(), q[t, 0, 2 * i + 1].item()
            want = (
                x1 * math.cos(angle) - x2 * math.sin(angle),
                x2 * math.cos(angle) + x1 * math.sin(angle),
            )
            assert got[t, 0, 2 * i : 2 * i + 2].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(got[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("is_neox", [True, False])
def test_bf16_is_one_rounding_of_the_fp32_result(is_neox):
    cache, _ = compute_cos_sin_cache(64, MAX_POSITION, BASE, None)
    positions = torch.randint(0, MAX_POSITION, (6,))
    q, k = random_qk(6, 64, torch.bfloat16)
    q_before = q.clone()
    got_q, got_k = apply_rotary_emb(positions, q, k, cache, 64, is_neox)
    want_q, want_k = apply_rotary_emb(positions, q.float(), k.float(), cache, 64, is_neox)
    assert got_q.dtype == torch.bfloat16 and torch.equal(q, q_before)  # new tensors
    # The math runs in fp32 from the bf16 inputs, so the only error is the final rounding.
    assert torch.equal(got_q, want_q.bfloat16()) and torch.equal(got_k, want_k.bfloat16())
