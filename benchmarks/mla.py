"""MLA kernel benchmark on a CUDA GPU at DeepSeek-V3 shapes (128 heads, L=512, R=64, bf16).

Decode: GB/s of latent cache read (every context row, L + R channels, once per step).
Prefill: TFLOP/s of the up-projected path, counting the expansion of the prefill sequences'
latents through W_UK / W_UV and the causal attention (q.k over Dn + R, p.v over Dv).
Times are medians of triton.testing.do_bench. Usage, from the repository root:
    PYTHONPATH=packages/atom-core/src:. python benchmarks/mla.py [--block-size 64] [--sweep]
        [--json out.json]
--sweep times the decode launch configurations and prints the best three per shape.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton

from atom.forward_context import AttentionMetadata
from atom.kernels.triton import mla
from benchmarks.kernel_timings import report, shuffled_block_tables
from benchmarks.timing import H100_PEAK_GBPS, H100_PEAK_TFLOPS, bench

HEADS, LATENT, ROPE, NOPE, VALUE = 128, 512, 64, 128, 128
SCALE = (NOPE + ROPE) ** -0.5
DECODE_SHAPES = [(batch, ctx) for batch in (1, 64, 256) for ctx in (1024, 4096, 8192)]
# (prompts, cached context, new tokens): whole prompts, then one chunk after a long prefix.
PREFILL_SHAPES = [(1, 0, 1024), (1, 0, 4096), (1, 0, 8192), (4, 0, 4096), (1, 7680, 512)]


def latent_batch(query_lens, seq_lens, block_size):
    """Metadata over shuffled pages and a random bf16 latent cache holding every row."""
    tables = shuffled_block_tables(seq_lens, block_size)
    slots = [-1] * sum(query_lens)  # the new tokens' latents already sit in the cache
    md = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device="cuda")
    cache = torch.randn(
        sum(map(len, tables)), block_size, LATENT + ROPE, device="cuda", dtype=torch.bfloat16
    )
    return md, cache


def decode_call(batch, ctx, block_size):
    md, cache = latent_batch([1] * batch, [ctx] * batch, block_size)
    q_latent = torch.randn(batch, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, HEADS, ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q_latent)
    return partial(mla.mla_decode_attention_triton, q_latent, q_pe, cache, md, SCALE, out)


def decode_gbps(batch, ctx, ms) -> float:
    return batch * ctx * (LATENT + ROPE) * 2 / ms / 1e6


def decode_rows(block_size):
    for batch, ctx in DECODE_SHAPES:
        ms = bench(decode_call(batch, ctx, block_size))
        gbps = decode_gbps(batch, ctx, ms)
        yield {"kernel": "MLA decode", "shape": f"{batch} seqs x {ctx} ctx", "ms": ms,
               "GB/s": gbps, "peak_fraction": gbps / H100_PEAK_GBPS}  # fmt: skip


def prefill_rows(block_size):
    for prompts, context, new in PREFILL_SHAPES:
        md, cache = latent_batch([new] * prompts, [context + new] * prompts, block_size)
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        q_nope = torch.randn(prompts * new, HEADS, NOPE, **bf16)
        q_pe = torch.randn(prompts * new, HEADS, ROPE, **bf16)
        w_uk = torch.randn(HEADS, NOPE, LATENT, **bf16) * LATENT**-0.5
        w_uv = torch.randn(HEADS, VALUE, LATENT, **bf16) * LATENT**-0.5
        out = q_nope.new_empty(prompts * new, HEADS, VALUE)
        fn = partial(
            mla.mla_prefill_attention_triton, q_nope, q_pe, cache, md, SCALE, w_uk, w_uv, out
        )
        try:
            ms = bench(fn)
        except triton.runtime.errors.OutOfResources as exc:  # a launch config too big
            print(f"MLA prefill {prompts} x {new} after {context}: {exc}")
            continue
        keys = context + new
        visible = new * context + new * (new + 1) / 2  # causal (query, key) pairs
        attention = 2 * visible * (NOPE + ROPE + VALUE)
        expansion = 2 * keys * LATENT * (NOPE + VALUE)
        flops = prompts * HEADS * (attention + expansion)
        tflops = flops / ms / 1e9
        shape = f"{prompts} x {new} tokens" + (f" after {context}" if context else "")
        yield {"kernel": "MLA prefill", "shape": shape, "ms": ms, "TFLOP/s": tflops,
               "peak_fraction": tflops / H100_PEAK_TFLOPS["bf16"]}  # fmt: skip


def sweep_decode(block_size) -> None:
    space = {
        "block_h": [16, 32, 64],
        "block_n": [16, 32, 64],
        "num_warps": [8],
        "num_stages": [2, 3],
    }
    default = dict(mla.DECODE_CONFIG)
    for batch, ctx in [(1, 8192), (64, 4096), (256, 1024)]:
        call = decode_call(batch, ctx, block_size)
        results = []
        for values in itertools.product(*space.values()):
            mla.DECODE_CONFIG.update(zip(space, values))
            try:
                ms = bench(call)
            except Exception as exc:  # out of shared memory or registers for some configs
                print(f"  skip {dict(mla.DECODE_CONFIG)}: {type(exc).__name__}")
                continue
            results.append((decode_gbps(batch, ctx, ms), dict(mla.DECODE_CONFIG)))
        results.sort(key=lambda r: -r[0])
        for gbps, cfg in results[:3]:
            print(f"decode {batch}x{ctx:<6} {gbps:8.0f} GB/s  {cfg}", flush=True)
    mla.DECODE_CONFIG.update(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-size", type=int, default=64, help="cache page size in tokens")
    parser.add_argument("--sweep", action="store_true", help="tune the decode launch instead")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.sweep:
        sweep_decode(args.block_size)
        return
    report([*decode_rows(args.block_size), *prefill_rows(args.block_size)], args.json, (12, 26))


if __name__ == "__main__":
    main()
