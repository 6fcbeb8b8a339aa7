"""Triton MLA kernels against their torch references (atom.kernels.mla).

Small shapes run on CPU under Triton's interpreter (TRITON_INTERPRET=1, fp32); DeepSeek-V3
shapes (128 heads, L=512, R=64, contexts to 8k), bf16 and CUDA-graph replay need a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from atom.forward_context import AttentionMetadata
from atom.kernels.few_queries import few_queries_as_decodes
from atom.kernels.mla import (
    mla_decode_attention_torch,
    mla_prefill_attention_torch,
    write_mla_cache_torch,
)
from atom.layers.attention_spec import AttentionSpec
from atom.layers.mla_impl import NativeMLAImpl
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import mla  # noqa: E402

# The interpreter computes bf16 through numpy, which has no bf16: check it on the GPU only.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
V3 = dict(heads=128, latent=512, rope=64, nope=128, value=128)
GPU = pytest.mark.gpu


def randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def paged_metadata(query_lens, seq_lens, block_size, seed=0):
    """Decode-first metadata over pages scattered through a pool; returns it and the pool size."""
    pages_needed = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(pages_needed) + 3))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in pages_needed]
    slots = [
        t[p // block_size] * block_size + p % block_size
        for q, s, t in zip(query_lens, seq_lens, tables)
        for p in range(s - q, s)
    ]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=DEVICE)
    return md, sum(pages_needed) + 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent, rope", [(32, 16), (512, 64)])
def test_write_mla_cache(dtype, latent, rope):
    num_blocks, block_size, tokens = 12, 16, 70
    # kv_c and k_pe are views of one projection, as in the model.
    kv = randn(tokens, latent + rope, dtype=dtype, seed=0)
    kv_c, k_pe = kv.split([latent, rope], dim=-1)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::5] = -1
    caches = [randn(num_blocks, block_size, latent + rope, dtype=dtype, seed=1) for _ in range(2)]
    mla.write_mla_cache_triton(kv_c, k_pe, caches[0], slots)
    write_mla_cache_torch(kv_c, k_pe, caches[1], slots)
    assert torch.equal(caches[0], caches[1])


DECODE_CASES = [
    # seq lens (context + the new token), block size, heads, latent, rope
    pytest.param([6, 21, 1, 40], 16, 4, 32, 8, id="deepseek-test-shape"),
    pytest.param([1, 100, 33, 64], 1, 16, 32, 16, id="small-block1"),
    pytest.param([200, 3, 129], 64, 40, 64, 16, id="ragged-head-blocks"),
    pytest.param([8192, 1, 3000, 4097], 64, 128, 512, 64, id="v3-block64", marks=GPU),
    pytest.param([8191, 8192, 15], 16, 16, 512, 64, id="h16-block16", marks=GPU),
    pytest.param([777, 2048, 64, 5000], 1, 128, 512, 64, id="v3-block1", marks=GPU),
]


def decode_inputs(seq_lens, block_size, heads, latent, rope, dtype, seed=0):
    md, num_pages = paged_metadata([1] * len(seq_lens), seq_lens, block_size, seed)
    cache = randn(num_pages, block_size, latent + rope, dtype=dtype, seed=seed)
    q_latent = randn(len(seq_lens), heads, latent, dtype=dtype, seed=seed + 1)
    q_pe = randn(len(seq_lens), heads, rope, dtype=dtype, seed=seed + 2)
    return q_latent, q_pe, cache, md


def check_decode(q_latent, q_pe, cache, md, dtype):
    scale = 192**-0.5
    got = mla.mla_decode_attention_triton(
        q_latent, q_pe, cache, md, scale, torch.empty_like(q_latent)
    )
    want = mla_decode_attention_torch(q_latent, q_pe, cache, md, scale, torch.empty_like(q_latent))
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens, block_size, heads, latent, rope", DECODE_CASES)
@pytest.mark.parametrize("target_programs", [mla.TARGET_PROGRAMS, 1], ids=["split-k", "one-split"])
def test_mla_decode(monkeypatch, dtype, seq_lens, block_size, heads, latent, rope, target_programs):
    monkeypatch.setattr(mla, "TARGET_PROGRAMS", target_programs)
    inputs = decode_inputs(seq_lens, block_size, heads, latent, rope, dtype)
    check_decode(*inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens, block_size, heads, latent, rope",
    [
        pytest.param([6, 21, 4, 40], 16, 4, 32, 8, id="small"),
        pytest.param([8192, 4, 3000], 64, 128, 512, 64, id="v3", marks=GPU),
    ],
)
@pytest.mark.parametrize("target_programs", [mla.TARGET_PROGRAMS, 1], ids=["split-k", "one-split"])
def test_mla_decode_of_a_verify_step(
    monkeypatch, dtype, seq_lens, block_size, heads, latent, rope, target_programs
):
    """Four causal queries per sequence (a speculative verify step) as the kernel gets
    them from few_queries_as_decodes, against the reference."""
    monkeypatch.setattr(mla, "TARGET_PROGRAMS", target_programs)
    queries = 4
    md, num_pages = paged_metadata([queries] * len(seq_lens), seq_lens, block_size)
    md = few_queries_as_decodes(md)
    assert md.num_decodes == len(seq_lens)
    cache = randn(num_pages, block_size, latent + rope, dtype=dtype, seed=0)
    q_latent = randn(md.num_tokens, heads, latent, dtype=dtype, seed=1)
    q_pe = randn(md.num_tokens, heads, rope, dtype=dtype, seed=2)
    check_decode(q_latent, q_pe, cache, md, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [64, 256])
def test_mla_decode_v3_batches(dtype, batch):
    seq_lens = [random.Random(batch).randint(1, 4096) for _ in range(batch)]
    inputs = decode_inputs(seq_lens, 16, V3["heads"], V3["latent"], V3["rope"], dtype)
    check_decode(*inputs, dtype)


V3_PREFILL = tuple(V3[k] for k in ("heads", "nope", "rope", "value", "latent"))
PREFILL_CASES = [
    # decode seq lens, prefills (cached context, new tokens), block size, heads, nope, rope,
    # value, latent
    pytest.param(
        [6, 20], [(0, 9), (13, 5), (17, 23)], 16, 4, 16, 8, 12, 32, id="deepseek-test-shape"
    ),
    pytest.param([], [(0, 40), (30, 1), (5, 70)], 1, 4, 16, 16, 12, 32, id="block1"),
    pytest.param([9], [(100, 30)], 64, 3, 32, 16, 16, 64, id="prefix-block64"),
    pytest.param([100, 4000], [(0, 1000), (3000, 700)], 64, *V3_PREFILL, id="v3", marks=GPU),
    pytest.param([5], [(0, 300), (64, 4100)], 16, *V3_PREFILL, id="v3-long-prompt", marks=GPU),
    pytest.param([], [(0, 2048)] * 2, 16, 16, 128, 64, 128, 512, id="h16", marks=GPU),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "decodes, prefills, block_size, heads, nope, rope, value, latent", PREFILL_CASES
)
def test_mla_prefill(dtype, decodes, prefills, block_size, heads, nope, rope, value, latent):
    def cache(num_pages):
        return randn(num_pages, block_size, latent + rope, dtype=dtype, seed=1)

    check_prefill(dtype, decodes, prefills, block_size, heads, nope, rope, value, latent, cache)


def check_prefill(
    dtype, decodes, prefills, block_size, heads, nope, rope, value, latent, make_cache,
    kv_scale=1.0,
):  # fmt: skip
    """Triton's prefill against the reference over a cache of `make_cache(num_pages)`."""
    query_lens = [1] * len(decodes) + [n for _, n in prefills]
    seq_lens = decodes + [c + n for c, n in prefills]
    md, num_pages = paged_metadata(query_lens, seq_lens, block_size)
    assert md.num_decodes == len(decodes)
    cache = make_cache(num_pages)
    w_uk = randn(heads, nope, latent, dtype=dtype, seed=2) * latent**-0.5
    w_uv = randn(heads, value, latent, dtype=dtype, seed=3) * latent**-0.5
    num_prefill_tokens = md.num_tokens - md.num_decode_tokens
    q_nope = randn(num_prefill_tokens, heads, nope, dtype=dtype, seed=4)
    q_pe = randn(num_prefill_tokens, heads, rope, dtype=dtype, seed=5)
    args = (q_nope, q_pe, cache, md, (nope + rope) ** -0.5, w_uk, w_uv)
    out = q_nope.new_empty(num_prefill_tokens, heads, value)
    got = mla.mla_prefill_attention_triton(*args, out.clone(), kv_scale)
    want = mla_prefill_attention_torch(*args, out.clone(), kv_scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


FP8 = torch.float8_e4m3fn
KV_SCALE = 0.125
FP8_GPU = pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9),
    reason="float8_e4m3fn needs compute capability 8.9+",
)


def fp8_cache(num_pages, block_size, width, seed):
    rows = randn(num_pages, block_size, width, dtype=torch.float32, seed=seed)
    return (rows / KV_SCALE).to(FP8)


@FP8_GPU
@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="Triton 3.9's interpreter rounds float32 -> e4m3 wrongly (-7.88 / 1 -> -4.0)",
)
def test_write_mla_cache_fp8():
    latent, rope, num_blocks, block_size, tokens = 32, 16, 12, 16, 70
    kv = randn(tokens, latent + rope, dtype=torch.float32, seed=0)
    kv_c, k_pe = kv.split([latent, rope], dim=-1)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::5] = -1
    caches = [fp8_cache(num_blocks, block_size, latent + rope, seed=1) for _ in range(2)]
    mla.write_mla_cache_triton(kv_c, k_pe, caches[0], slots, KV_SCALE)
    write_mla_cache_torch(kv_c, k_pe, caches[1], slots, KV_SCALE)
    # Division by the scale may round one e4m3 step differently on the GPU.
    torch.testing.assert_close(caches[0].float(), caches[1].float(), rtol=0.125, atol=2**-9)


@FP8_GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens, block_size, heads, latent, rope", DECODE_CASES)
def test_mla_decode_fp8_cache(dtype, seq_lens, block_size, heads, latent, rope):
    q_latent, q_pe, _, md = decode_inputs(seq_lens, block_size, heads, latent, rope, dtype)
    cache = fp8_cache(md.block_table.max().item() + 1, block_size, latent + rope, seed=7)
    scale = 192**-0.5
    args = (q_latent, q_pe, cache, md, scale)
    got = mla.mla_decode_attention_triton(*args, torch.empty_like(q_latent), KV_SCALE)
    want = mla_decode_attention_torch(*args, torch.empty_like(q_latent), KV_SCALE)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@FP8_GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "decodes, prefills, block_size, heads, nope, rope, value, latent", PREFILL_CASES
)
def test_mla_prefill_fp8_cache(
    dtype, decodes, prefills, block_size, heads, nope, rope, value, latent
):
    def cache(num_pages):
        return fp8_cache(num_pages, block_size, latent + rope, seed=1)

    check_prefill(
        dtype, decodes, prefills, block_size, heads, nope, rope, value, latent, cache, KV_SCALE
    )


def native_impl(device) -> NativeMLAImpl:
    spec = AttentionSpec(
        layer_name="attn", num_heads=4, num_kv_heads=1, head_dim=24, v_head_dim=12, scale=1.0,
        kind="MLA", kv_lora_rank=32, qk_rope_head_dim=8,
        kv_b_proj=nn.Linear(32, 4 * (16 + 12), bias=False, device=device),
    )  # fmt: skip
    return NativeMLAImpl(spec)


def test_native_impl_graph_safe_only_with_triton_kernels():
    assert not native_impl("cpu").cuda_graph_safe  # the torch reference loops on the host
    if DEVICE == "cuda":
        assert native_impl("cuda").cuda_graph_safe


@pytest.mark.gpu
def test_decode_replays_in_a_cuda_graph():
    """Capture cache write + decode once, replay with other lengths, pages and contents."""
    dtype, block_size, width = torch.bfloat16, 16, 512
    heads, latent, rope = V3["heads"], V3["latent"], V3["rope"]
    scale = 192**-0.5

    pool_pages = 4 * width

    def batch(seq_lens, seed):
        md, num_pages = paged_metadata([1] * len(seq_lens), seq_lens, block_size, seed)
        assert num_pages <= pool_pages
        tensors = {
            "q_latent": randn(len(seq_lens), heads, latent, dtype=dtype, seed=seed),
            "q_pe": randn(len(seq_lens), heads, rope, dtype=dtype, seed=seed + 1),
            "kv_c": randn(len(seq_lens), latent, dtype=dtype, seed=seed + 2),
            "k_pe": randn(len(seq_lens), rope, dtype=dtype, seed=seed + 3),
        }
        return md, tensors

    cache = randn(pool_pages, block_size, latent + rope, dtype=dtype, seed=9)
    md, static = batch([10, 300, 8000, 1], seed=0)
    table = torch.zeros(4, width, dtype=torch.int32, device=DEVICE)
    table[:, : md.block_table.shape[1]] = md.block_table
    md.block_table = table
    out = torch.empty_like(static["q_latent"])

    def step():
        mla.write_mla_cache_triton(static["kv_c"], static["k_pe"], cache, md.slot_mapping)
        mla.mla_decode_attention_triton(static["q_latent"], static["q_pe"], cache, md, scale, out)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    new_md, new = batch([8192, 2, 4000, 513], seed=5)
    for name, tensor in new.items():
        static[name].copy_(tensor)
    md.seq_lens.copy_(new_md.seq_lens)
    md.slot_mapping.copy_(new_md.slot_mapping)
    table.zero_()[:, : new_md.block_table.shape[1]] = new_md.block_table
    want_cache = cache.clone()
    graph.replay()

    write_mla_cache_torch(new["kv_c"], new["k_pe"], want_cache, new_md.slot_mapping)
    assert torch.equal(cache, want_cache)
    want = mla_decode_attention_torch(
        new["q_latent"], new["q_pe"], want_cache, new_md, scale, torch.empty_like(out)
    )
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
