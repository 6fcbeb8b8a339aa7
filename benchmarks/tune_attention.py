"""Sweeps the paged-attention launch parameters on a GPU and prints the best per shape.

Decode: DECODE_CONFIG of atom.kernels.triton.paged_attention. Prefill: the configs of
atom.kernels.triton.prefill_attention (SHORT / MEDIUM / LONG by query length), timed
with the new tokens' K/V dense, as every host runs it; the prefixed shape times the
cached-prefix path. Usage: python benchmarks/tune_attention.py [--only decode|prefill]
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton

from atom.kernels.triton import paged_attention as pa
from atom.kernels.triton import prefill_attention as prefill
from benchmarks.kernels import paged_batch

SCALE = 128**-0.5


def best(label: str, runs, unit: str) -> None:
    """runs: (config, callable, work) for one shape; prints the three fastest."""
    results = []
    for config, fn, work in runs:
        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=40)
        except Exception as exc:  # out of shared memory for some configs
            print(f"  skip {config}: {type(exc).__name__}", flush=True)
            continue
        results.append((work / ms, config))
    results.sort(key=lambda r: -r[0])
    for rate, config in results[:3]:
        print(f"{label:<26} {rate:8.0f} {unit}  {config}", flush=True)


def configs(space: dict):
    for values in itertools.product(*space.values()):
        yield dict(zip(space, values))


def tune_decode() -> None:
    shapes = {"decode 64x8192": (64, 8192), "decode 16x8192": (16, 8192),
              "decode 256x1024": (256, 1024)}  # fmt: skip
    space = {"num_splits": [1, 2, 4, 8, 16], "block_n": [32, 64], "num_warps": [2, 4],
             "num_stages": [2, 3]}  # fmt: skip
    default = dict(pa.DECODE_CONFIG)
    for label, (batch, ctx) in shapes.items():
        q, k, v, md, _, _ = paged_batch([1] * batch, [ctx - 1] * batch)
        out = torch.empty_like(q)
        gbytes = 2 * batch * ctx * 8 * 128 * 2 / 1e6  # GB/s from bytes / 1e6 / ms
        fn = partial(pa.paged_attention_triton, q, k, v, md, SCALE, None, None, out)

        def runs(fn=fn, gbytes=gbytes):
            for config in configs(space):  # decode reads its module's config: set it while timed
                pa.DECODE_CONFIG.clear()
                pa.DECODE_CONFIG.update(config)
                yield config, fn, gbytes

        best(label, runs(), "GB/s")
    pa.DECODE_CONFIG.clear()
    pa.DECODE_CONFIG.update(default)


def tune_prefill() -> None:
    # label: (new tokens per sequence, cached context, sequences)
    shapes = {
        "prefill 64x512 (SHORT)": (512, 0, 64),
        "prefill 16x2048 (MEDIUM)": (2048, 0, 16),
        "prefill 4x8192 (LONG)": (8192, 0, 4),
        "prefill 8x1024 +1024 ctx": (1024, 1024, 8),
    }
    space = {"block_m": [64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8],
             "num_stages": [2, 3, 4], "tma": [True, False]}  # fmt: skip
    for label, (length, ctx, batch) in shapes.items():
        q, k, v, md, key, value = paged_batch([length] * batch, [ctx] * batch)
        out = torch.empty_like(q)
        # Query-key pairs: the causal half of the new block plus the whole prefix.
        tflop = 4 * batch * (length * length / 2 + length * ctx) * 32 * 128 / 1e9
        runs = [
            (c, partial(prefill.prefill_attention, q, k, v, md, SCALE, None, None, out,
                        key, value, config=c), tflop)
            for c in configs(space)
        ]  # fmt: skip
        best(label, runs, "TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["decode", "prefill"])
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.only != "prefill":
        tune_decode()
    if args.only != "decode":
        tune_prefill()


if __name__ == "__main__":
    main()
