"""Sweeps the paged-attention launch parameters on a GPU and prints the best per shape."""

from __future__ import annotations

import itertools
from functools import partial

import torch
import triton

from atom.kernels.triton import paged_attention as pa
from benchmarks.kernels import paged_batch


def sweep(config: dict, space: dict, shapes, work, unit: str) -> None:
    for label, (q_lens, ctx) in shapes.items():
        q, k, v, md = paged_batch(q_lens, ctx)
        out = torch.empty_like(q)
        results = []
        for values in itertools.product(*space.values()):
            config.update(zip(space, values))
            try:
                fn = partial(pa.paged_attention_triton, q, k, v, md, 128**-0.5, None, None, out)
                ms = triton.testing.do_bench(fn, warmup=10, rep=40)
            except Exception as exc:  # out of shared memory for some configs
                print(f"  skip {dict(config)}: {type(exc).__name__}")
                continue
            results.append((work[label] / ms, dict(config)))
        results.sort(key=lambda r: -r[0])
        for rate, cfg in results[:3]:
            print(f"{label:<22} {rate:8.0f} {unit}  {cfg}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    decode = {
        "decode 64x8192": ([1] * 64, [8191] * 64),
        "decode 16x8192": ([1] * 16, [8191] * 16),
        "decode 256x1024": ([1] * 256, [1023] * 256),
    }
    # rate = work / ms: GB/s from bytes / 1e6, TFLOP/s from flops / 1e9.
    decode_bytes = {k: 2 * len(v[0]) * (v[1][0] + 1) * 8 * 128 * 2 / 1e6 for k, v in decode.items()}
    sweep(
        pa.DECODE_CONFIG,
        {
            "num_splits": [1, 2, 4, 8, 16],
            "block_n": [32, 64],
            "num_warps": [2, 4],
            "num_stages": [2, 3],
        },
        decode,
        decode_bytes,
        "GB/s",
    )
    prefill_space = {
        "rows": [64, 128],
        "block_n": [32, 64, 128],
        "num_warps": [4, 8],
        "num_stages": [2, 3, 4],
        "warp_specialize": [False, True],
    }
    for config, (label, batch, length) in [
        (pa.PREFILL_CONFIG, ("prefill 16x2048", 16, 2048)),
        (pa.LONG_PREFILL_CONFIG, ("prefill 4x8192", 4, 8192)),
    ]:
        flops = {label: 2 * batch * length**2 * 32 * 128 / 1e9}
        sweep(config, prefill_space, {label: ([length] * batch, [0] * batch)}, flops, "TFLOP/s")


if __name__ == "__main__":
    main()
