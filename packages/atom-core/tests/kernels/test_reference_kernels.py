"""The torch reference kernels against independent definitions: HF's modules and naive loops."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from atom import kernels
from atom.forward_context import AttentionMetadata
from atom.kernels import policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    torch.nn.init.normal_(hf.weight)
    x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    assert torch.equal(kernels.rms_norm(x, hf.weight, 1e-5), hf(x))
    normed, new_residual = kernels.fused_add_rms_norm(x, residual, hf.weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, hf(x + residual))


def test_silu_and_mul():
    x = torch.randn(5, 2 * 48)
    assert torch.equal(kernels.silu_and_mul(x), F.silu(x[:, :48]) * x[:, 48:])


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
}  # fmt: skip


def hf_inv_freq(rotary_dim: int, base: float, scaling: dict | None):
    params = {"rope_theta": base, "rope_type": "default", **(scaling or {})}
    config = SimpleNamespace(
        rope_parameters=params, head_dim=rotary_dim, hidden_size=rotary_dim, num_attention_heads=1,
        max_position_embeddings=256, standardize_rope_params=lambda: None,
    )  # fmt: skip
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_cos_sin_cache_matches_hf(name):
    scaling = ROPE_CASES[name]
    cache, attention_scale = kernels.compute_cos_sin_cache(64, 256, 10000.0, scaling)
    if scaling is None:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
        factor = 1.0
    else:
        inv_freq, factor = hf_inv_freq(64, 10000.0, scaling)
    freqs = torch.outer(torch.arange(256).float(), inv_freq)
    torch.testing.assert_close(cache, torch.cat([freqs.cos(), freqs.sin()], -1) * factor)
    expected_scale = (0.1 * math.log(40.0) + 1.0) ** 2 if name == "yarn-deepseek" else 1.0
    assert attention_scale == pytest.approx(expected_scale)


def test_unknown_rope_type_is_named():
    with pytest.raises(ValueError, match="'dynamic'"):
        kernels.compute_cos_sin_cache(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_neox_rotary_matches_hf(rotary_dim):
    cache, _ = kernels.compute_cos_sin_cache(rotary_dim, 128, 10000.0, None)
    positions = torch.randint(0, 128, (9,))
    q, k = torch.randn(9, 4, 64), torch.randn(9, 2, 64)
    got_q, got_k = kernels.apply_rotary_emb(positions, q, k, cache, rotary_dim, True)
    cos, sin = cache[positions].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    # HF rotates [batch, heads, seq, dim]; the channels past rotary_dim pass through.
    want_q, want_k = apply_rotary_pos_emb(
        q[..., :rotary_dim].transpose(0, 1)[None],
        k[..., :rotary_dim].transpose(0, 1)[None],
        cos[None],
        sin[None],
    )
    torch.testing.assert_close(got_q[..., :rotary_dim], want_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k[..., :rotary_dim], want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])


def test_gptj_rotary_rotates_adjacent_pairs():
    cache, _ = kernels.compute_cos_sin_cache(8, 16, 10000.0, None)
    q = torch.randn(3, 1, 8)
    positions = torch.tensor([0, 5, 15])
    got, _ = kernels.apply_rotary_emb(positions, q, q.clone(), cache, 8, False)
    for t, p in enumerate(positions.tolist()):
        for i in range(4):
            angle = p / 10000.0 ** (2 * i / 8)
            x1, x2 = q[t, 0, 2 * i].item(), q[t, 0, 2 * i + 1].item()
            assert got[t, 0, 2 * i].item() == pytest.approx(
                x1 * math.cos(angle) - x2 * math.sin(angle), abs=1e-5
            )
            assert got[t, 0, 2 * i + 1].item() == pytest.approx(
                x2 * math.cos(angle) + x1 * math.sin(angle), abs=1e-5
            )


def test_write_kv_cache_skips_padding():
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 6)
    key_cache, value_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 6)
    kernels.write_kv_cache(key, value, key_cache, value_cache, torch.tensor([5, -1, 11, 0]))
    assert torch.equal(key_cache[1, 1], key[0]) and torch.equal(value_cache[2, 3], value[2])
    assert torch.equal(key_cache[0, 0], key[3])
    assert int((key_cache.abs().sum(-1) != 0).sum()) == 3 * 2  # three tokens, two heads


def naive_attention(q, k, v, positions, scale, window, soft_cap):
    """One query row at a time, straight from the definition."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    for t, pos in enumerate(positions):
        for h in range(q.shape[1]):
            keys = [j for j in range(pos + 1) if window is None or j > pos - window]
            scores = torch.stack([q[t, h] @ k[j, h // group] * scale for j in keys])
            if soft_cap:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            out[t, h] = sum(p * v[j, h // group] for p, j in zip(scores.softmax(0), keys))
    return out


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (5, None), (None, 20.0)])
def test_paged_attention_mixed_batch(group, block_size, window, soft_cap):
    rng = random.Random(group * 100 + block_size)
    kv_heads, head_dim, v_dim = 2, 16, 12
    # decodes first (context 9 and 40), then a fresh prefill and one with a cached prefix
    contexts, new = [9, 40, 0, 21], [1, 1, 13, 6]
    seqs_k = [torch.randn(c + n, kv_heads, head_dim) for c, n in zip(contexts, new)]
    seqs_v = [torch.randn(c + n, kv_heads, v_dim) for c, n in zip(contexts, new)]
    pages = list(range(160))
    rng.shuffle(pages)
    key_cache = torch.zeros(160, block_size, kv_heads, head_dim)
    value_cache = torch.zeros(160, block_size, kv_heads, v_dim)
    tables = []
    for k, v in zip(seqs_k, seqs_v):
        table = [pages.pop() for _ in range(-(-len(k) // block_size))]
        tables.append(table)
        for pos in range(len(k)):
            key_cache[table[pos // block_size], pos % block_size] = k[pos]
            value_cache[table[pos // block_size], pos % block_size] = v[pos]
    md = AttentionMetadata.build(
        new, [c + n for c, n in zip(contexts, new)], tables, [-1] * sum(new)
    )
    q = torch.randn(sum(new), kv_heads * group, head_dim)
    out = kernels.paged_attention(
        q, key_cache, value_cache, md, 0.3, sliding_window=window, logits_soft_cap=soft_cap
    )
    start = 0
    for c, n, k, v in zip(contexts, new, seqs_k, seqs_v):
        want = naive_attention(
            q[start : start + n], k, v, list(range(c, c + n)), 0.3, window, soft_cap
        )
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_paged_attention_bf16_close_to_fp32():
    md = AttentionMetadata.build([5], [5], [[0]], [0, 1, 2, 3, 4])
    q, k, v = torch.randn(5, 4, 32), torch.randn(1, 16, 2, 32), torch.randn(1, 16, 2, 32)
    ref = kernels.paged_attention(q, k, v, md, 0.2)
    low = kernels.paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), md, 0.2)
    # Inputs rounded to bf16 (8 bits of mantissa) move outputs of magnitude ~1 by < 2e-2.
    torch.testing.assert_close(low.float(), ref, atol=2e-2, rtol=2e-2)


E4M3_MAX = 448.0


def test_fp8_per_tensor_and_per_token_round_trip():
    x = torch.randn(16, 64) * 3
    q, scale = kernels.quantize_fp8_per_tensor(x)
    assert q.dtype == torch.float8_e4m3fn and scale.item() == pytest.approx(
        x.abs().max().item() / E4M3_MAX
    )
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values.
    torch.testing.assert_close(
        kernels.dequantize_fp8(q, scale), x, atol=scale.item() * 2**-6 * E4M3_MAX / 64, rtol=2**-4
    )
    q, scale = kernels.quantize_fp8_per_token(x)
    assert scale.shape == (16, 1)
    torch.testing.assert_close(kernels.dequantize_fp8(q, scale), x, atol=0.02, rtol=2**-4)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_fp8_block_quantization(shape):
    w = torch.randn(shape)
    q, scale = kernels.quantize_fp8_per_block(w)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scale[i, j].item() == pytest.approx(tile.abs().max().item() / E4M3_MAX)
    torch.testing.assert_close(
        kernels.dequantize_fp8(q, scale, (128, 128)), w, atol=0.02, rtol=2**-4
    )


@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_fp8_scaled_mm_matches_dequantized_matmul(mode):
    a, b = torch.randn(9, 256), torch.randn(130, 256)
    if mode == "block":
        a_q, a_s = kernels.quantize_fp8_per_token_group(a, 128)
        b_q, b_s = kernels.quantize_fp8_per_block(b)
        block = (128, 128)
        a_ref = (a_q.float().view(9, 2, 128) * a_s[..., None]).view(9, 256)
        b_ref = kernels.dequantize_fp8(b_q, b_s, block)
    else:
        a_q, a_s = kernels.quantize_fp8_per_tensor(a)
        b_q, b_s = (
            kernels.quantize_fp8_per_tensor(b)
            if mode == "tensor"
            else kernels.quantize_fp8_per_token(b)
        )
        block = None
        a_ref, b_ref = a_q.float() * a_s, b_q.float() * b_s
    bias = torch.randn(130)
    got = kernels.fp8_scaled_mm(a_q, a_s, b_q, b_s, torch.float32, bias, block_size=block)
    torch.testing.assert_close(got, a_ref @ b_ref.T + bias, atol=1e-4, rtol=1e-5)


def test_policy_override_and_errors(monkeypatch):
    assert policy.selected_backend("rms_norm", "cpu") == "torch"
    monkeypatch.setenv("ATOM_KERNELS", "triton")
    assert policy.selected_backend("rms_norm", "cpu") == "torch"  # no Triton on CPU
    monkeypatch.setenv("ATOM_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="ATOM_KERNELS='cuda-magic'"):
        policy.dispatch("rms_norm", torch.device("cpu"))
    with pytest.raises(KeyError, match="no kernel registered for op 'nope'"):
        policy._select("nope", "cpu", None)
