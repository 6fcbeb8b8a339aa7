"""Kernel benchmark on a CUDA GPU: time, achieved GB/s or TFLOP/s, and fraction of peak.

Shapes follow shared/anchors (bf16, paged KV with 16-token blocks, 32 q / 8 kv heads,
head dim 128), so the figures sit next to vLLM's. Usage:
    PYTHONPATH=packages/atom-core/src:. python benchmarks/kernel_timings.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from functools import partial

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE
from atom.kernels.paged_attention import gather_pages
from atom.kernels.rotary import compute_cos_sin_cache
from atom.kernels.triton.activation import silu_and_mul_triton
from atom.kernels.triton.fused_qkv import fused_qkv_rope_write_kv_triton
from atom.kernels.triton.kv_cache import write_kv_cache_triton
from atom.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton
from atom.kernels.triton.paged_attention import paged_attention_triton
from atom.kernels.triton.rotary import apply_rotary_emb_triton
from benchmarks.timing import H100_PEAK_GBPS, H100_PEAK_TFLOPS, bench, interleaved, median_ratio


def shuffled_block_tables(seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Each sequence's block table, over a random order of all the pages (as a cache that
    has served a while hands them out), so no kernel gains from neighbouring pages."""
    pages = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(pages), dtype=torch.int32).tolist()
    starts = [sum(pages[:i]) for i in range(len(pages))]
    return [order[start : start + n] for start, n in zip(starts, pages)]


def paged_batch(q_lens, ctx_lens, heads=32, kv_heads=8, head_dim=128, block_size=16):
    """q, the key/value caches (pages in random order), the metadata, and the new tokens'
    dense key/value [T, Hkv, D]: the pages' contents at their positions, as a host has
    them after writing the cache."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    tables = shuffled_block_tables(seq_lens, block_size)
    slots = [-1] * sum(q_lens)  # K/V of new tokens already sit in the cache
    md = AttentionMetadata.build(q_lens, seq_lens, tables, slots, device="cuda")
    shape = (sum(map(len, tables)), block_size, kv_heads, head_dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    new = [(i, s - n, s) for i, (n, s) in enumerate(zip(q_lens, seq_lens))]
    key = torch.cat([gather_pages(k, md.block_table[i], s)[c:] for i, c, s in new])
    value = torch.cat([gather_pages(v, md.block_table[i], s)[c:] for i, c, s in new])
    return q, k, v, md, key, value


def fa3_paged_attention():
    """vLLM's FA3 over the same paged cache (the call in shared/anchors), or None without vLLM."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch
        return None

    def run(q, k, v, md, scale, out):
        return flash_attn_varlen_func(q, k, v, max_seqlen_q=md.max_query_len,
                                      cu_seqlens_q=md.query_start_loc, max_seqlen_k=md.max_seq_len,
                                      seqused_k=md.seq_lens, softmax_scale=scale, causal=True,
                                      block_table=md.block_table, out=out, fa_version=3)  # fmt: skip

    return run


def side_by_side(row: dict, atom_fn, fa3, q, k, v, md, rounds: int = 5) -> dict:
    """Times ATOM (row["ms"]) and, where vLLM is importable, FA3 on the same inputs
    (fa3_ms, vs_fa3 = FA3 time / ATOM time; 1.0: parity). The two alternate over `rounds`
    and each gets its median: a GPU's clock drifts between back-to-back runs
    (docs/performance.md, "GPU clock drift")."""
    if fa3 is None:
        row["ms"] = bench(atom_fn)
        return row
    fa3_fn = partial(fa3, q, k, v, md, 128**-0.5, torch.empty_like(q))
    atom, fa3_times = interleaved([atom_fn, fa3_fn], rounds)
    row["ms"], row["fa3_ms"] = statistics.median(atom), statistics.median(fa3_times)
    row["vs_fa3"] = median_ratio(fa3_times, atom)
    return row


# (sequences, context): long and short contexts, few and many (sequence, kv head) programs.
DECODE_SHAPES = [(64, 8192), (16, 8192), (256, 1024), (128, 2048)]


def decode_rows():
    fa3 = fa3_paged_attention()
    for batch, ctx in DECODE_SHAPES:
        q, k, v, md, _, _ = paged_batch([1] * batch, [ctx - 1] * batch)
        out = torch.empty_like(q)
        fn = partial(paged_attention_triton, q, k, v, md, 128**-0.5, None, None, out)
        row = side_by_side({"kernel": "decode attention", "shape": f"{batch} seqs x {ctx} ctx"},
                           fn, fa3, q, k, v, md)  # fmt: skip
        gbps = 2 * batch * ctx * 8 * 128 * 2 / row["ms"] / 1e6  # K and V bytes read
        yield row | {"GB/s": gbps, "peak_fraction": gbps / H100_PEAK_GBPS}


def fp8_decode_rows():
    """Decode over an e4m3 cache (per-tensor scales, dequantized in the kernel) against the
    same kernel over the bf16 cache; fp8_vs_bf16 = fp8 time / bf16 time."""
    for batch, ctx in DECODE_SHAPES:
        q, k, v, md, _, _ = paged_batch([1] * batch, [ctx - 1] * batch)
        k8, v8 = (x.div(2.0).to(FP8_KV_CACHE_DTYPE) for x in (k, v))
        out, out8 = torch.empty_like(q), torch.empty_like(q)
        bf16 = partial(paged_attention_triton, q, k, v, md, 128**-0.5, None, None, out)
        fp8 = partial(paged_attention_triton, q, k8, v8, md, 128**-0.5, None, None, out8,
                      k_scale=2.0, v_scale=2.0)  # fmt: skip
        bf16(), fp8()
        error = (out.float() - out8.float()).abs().max().item()
        bf16_times, fp8_times = interleaved([bf16, fp8], 5)
        ms = statistics.median(fp8_times)
        gbps = 2 * batch * ctx * 8 * 128 / ms / 1e6  # one byte per K and V element
        yield {"kernel": "decode, fp8 KV", "shape": f"{batch} seqs x {ctx} ctx", "ms": ms,
               "bf16_ms": statistics.median(bf16_times),
               "fp8_vs_bf16": median_ratio(fp8_times, bf16_times), "max_abs_diff": error,
               "GB/s": gbps, "peak_fraction": gbps / H100_PEAK_GBPS}  # fmt: skip


def prefill_rows():
    fa3 = fa3_paged_attention()
    for batch, length in [(16, 2048), (4, 8192), (64, 512)]:
        q, k, v, md, key, value = paged_batch([length] * batch, [0] * batch)
        out = torch.empty_like(q)
        # Every host has the new tokens' K/V at hand (it has just written them): ATOM reads
        # them dense; FA3 reads everything from the pages, as in the anchors.
        fn = partial(paged_attention_triton, q, k, v, md, 128**-0.5, None, None, out, key, value)
        row = side_by_side({"kernel": "causal prefill", "shape": f"{batch} x {length} tokens"},
                           fn, fa3, q, k, v, md)  # fmt: skip
        flops = 4 * batch * length * length * 32 * 128 / 2  # causal: half the square
        tflops = flops / row["ms"] / 1e9
        yield row | {"TFLOP/s": tflops, "peak_fraction": tflops / H100_PEAK_TFLOPS["bf16"]}


def elementwise_rows():
    for tokens, hidden in [(4096, 4096), (16384, 4096)]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        ms = bench(partial(fused_add_rms_norm_triton, x, r, w, 1e-6))
        gbps = 4 * x.numel() * 2 / ms / 1e6  # read x, residual; write out, residual
        yield {"kernel": "fused add+RMSNorm", "shape": f"{tokens} x {hidden}", "ms": ms,
               "GB/s": gbps, "peak_fraction": gbps / H100_PEAK_GBPS}  # fmt: skip
        gate_up = torch.randn(tokens, 2 * hidden, device="cuda", dtype=torch.bfloat16)
        ms = bench(partial(silu_and_mul_triton, gate_up))
        gbps = 3 * x.numel() * 2 / ms / 1e6
        yield {"kernel": "SiLU-and-mul", "shape": f"{tokens} x {hidden}", "ms": ms,
               "GB/s": gbps, "peak_fraction": gbps / H100_PEAK_GBPS}  # fmt: skip


def unfused_qkv_rope_write_kv(q, k, v, positions, cos_sin, key_cache, value_cache, slots, w):
    """What the models ran before the fused kernel: five launches and q/k copies."""
    q, k = rms_norm_triton(q, w, 1e-6), rms_norm_triton(k, w, 1e-6)
    q, k = apply_rotary_emb_triton(positions, q, k, cos_sin, q.shape[-1], True)
    write_kv_cache_triton(k, v, key_cache, value_cache, slots)
    return q


def qkv_prologue_rows():
    # Qwen3-0.6B attention (16 q / 8 kv heads, d=128, q/k norm, neox): a 256-sequence
    # decode step and prefill chunks, KV into 16-token pages.
    heads, kv_heads, dim = 16, 8, 128
    cos_sin = compute_cos_sin_cache(dim, 8192, 1e6, None)[0].cuda()
    w = torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5
    for tokens in [256, 8192, 32768]:
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.view(tokens, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
        positions = torch.randint(0, 8192, (tokens,), device="cuda")
        cache_shape = (tokens // 16 + 1, 16, kv_heads, dim)
        key_cache = torch.empty(cache_shape, device="cuda", dtype=torch.bfloat16)
        value_cache = torch.empty_like(key_cache)
        slots = torch.randperm(tokens, device="cuda")
        gbytes = 2 * qkv.numel() * 2 / 1e9  # read q, k, v once; write q, k, v once
        for name, fn in [
            ("fused qk-norm+rope+KV", partial(fused_qkv_rope_write_kv_triton, q, k, v, positions,
             cos_sin, dim, True, key_cache, value_cache, slots, w, w, 1e-6)),
            ("unfused (5 kernels)", partial(unfused_qkv_rope_write_kv, q, k, v, positions,
             cos_sin, key_cache, value_cache, slots, w)),
        ]:  # fmt: skip
            ms = bench(fn)
            gbps = gbytes / ms * 1e3
            yield {"kernel": name, "shape": f"{tokens} tok 16q/8kv d128", "ms": ms,
                   "GB/s": gbps, "peak_fraction": gbps / H100_PEAK_GBPS}  # fmt: skip


ROWS = {
    "decode": decode_rows,
    "fp8-decode": fp8_decode_rows,
    "prefill": prefill_rows,
    "elementwise": elementwise_rows,
    "qkv-prologue": qkv_prologue_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--only", nargs="+", choices=ROWS, default=list(ROWS))
    args = parser.parse_args()
    torch.manual_seed(0)
    report((row for name in args.only for row in ROWS[name]()), args.json)


def report(rows: Iterable[dict], json_path: str | None, widths: tuple[int, int] = (22, 22)) -> None:
    """Prints each row (time, GB/s or TFLOP/s, fraction of peak, and FA3's time where the
    row has it) as it comes; with `json_path`, writes them all there."""
    kernel_width, shape_width = widths
    done = []
    print(
        f"{'kernel':<{kernel_width}} {'shape':<{shape_width}} {'ms':>9} {'GB/s | TFLOP/s':>16} {'of peak':>8}"
        f" {'FA3 ms':>9} {'FA3/ATOM':>8}"
    )
    for row in rows:
        unit = "GB/s" if "GB/s" in row else "TFLOP/s"
        fa3 = f" {row['fa3_ms']:>9.4f} {row['vs_fa3']:>8.2f}" if "fa3_ms" in row else ""
        if "fp8_vs_bf16" in row:
            fa3 = f"  bf16 {row['bf16_ms']:.4f} ms, fp8/bf16 {row['fp8_vs_bf16']:.2f}, max diff {row['max_abs_diff']:.3g}"
        print(
            f"{row['kernel']:<{kernel_width}} {row['shape']:<{shape_width}} {row['ms']:>9.4f} "
            f"{row[unit]:>10.0f} {unit:<5} {row['peak_fraction']:>7.1%}{fa3}",
            flush=True,
        )
        done.append(row)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(done, f, indent=1)


if __name__ == "__main__":
    main()
