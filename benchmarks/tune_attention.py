"""Sweeps the paged-attention launch parameters on a GPU and prints the best per shape
(and, where vLLM is importable, FA3's rate on the same prefill inputs).

Decode: DECODE_CONFIG of atom.kernels.triton.paged_attention. Prefill: the configs of
atom.kernels.triton.prefill_attention (SHORT / LONG by query length), timed with the new
tokens' K/V dense, as every host runs it; the prefixed shape times the cached-prefix path.
The prefill configs compile in parallel first (benchmarks/precompile.py), and each is
checked against the default config's output. Usage (repo root):
    PYTHONPATH=packages/atom-core/src:. python benchmarks/tune_attention.py \
        [--only decode|prefill] [--shapes LABEL ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import cache, partial

import torch
import triton

from atom.kernels.triton import paged_attention as pa
from atom.kernels.triton import prefill_attention as prefill
from benchmarks.kernel_timings import fa3_paged_attention, paged_batch
from benchmarks.precompile import precompile, worker_pool

SCALE = 128**-0.5


def best(label: str, runs, unit: str) -> list[tuple[float, dict]]:
    """runs: (config, callable, work) for one shape; prints the three fastest and returns
    every (rate, config), fastest first."""
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
    return results


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


# label: (new tokens per sequence, cached context, sequences, q heads, kv heads, head dim)
PREFILL_SHAPES = {
    "prefill 64x512 (SHORT)": (512, 0, 64, 32, 8, 128),
    "prefill 16x2048 (LONG)": (2048, 0, 16, 32, 8, 128),
    "prefill 4x8192 (LONG)": (8192, 0, 4, 32, 8, 128),
    "prefill 8x1024 +1024 ctx": (1024, 1024, 8, 32, 8, 128),
    # Qwen3-Next's full-attention layers (head dim 256), where WIDE_CONFIG runs today.
    "prefill 1x32768 d256": (32768, 0, 1, 16, 2, 256),
    "prefill 8x4096 d256": (4096, 0, 8, 16, 2, 256),
}
PREFILL_SPACE = {"block_m": [64, 128], "block_n": [64, 128], "num_warps": [4, 8],
                 "num_stages": [2, 3, 4], "tma": [True]}  # fmt: skip
# Head dim 256: a 128 x 256 fp32 accumulator fills a warp group's registers, and a K/V
# stage of 128 rows takes 128 KB of shared memory.
WIDE_HEAD_SPACE = {"block_m": [64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8],
                   "num_stages": [1, 2, 3], "tma": [True]}  # fmt: skip


def prefill_space(label: str) -> list[dict]:
    head_dim = PREFILL_SHAPES[label][5]
    return list(configs(PREFILL_SPACE if head_dim <= 128 else WIDE_HEAD_SPACE))


@cache
def prefill_inputs(label: str):
    length, ctx, batch, heads, kv_heads, head_dim = PREFILL_SHAPES[label]
    torch.manual_seed(0)
    q, k, v, md, key, value = paged_batch(
        [length] * batch, [ctx] * batch, heads, kv_heads, head_dim
    )
    return q, k, v, md, key, value, torch.empty_like(q)


def run_prefill(item) -> torch.Tensor:
    """One launch of config on a shape (also a precompile worker's job); returns the output."""
    label, config = item
    q, k, v, md, key, value, out = prefill_inputs(label)
    scale = PREFILL_SHAPES[label][5] ** -0.5
    prefill.prefill_attention(q, k, v, md, scale, None, None, out, key, value, config=config)
    return out


def tune_prefill(shapes: list[str], pool) -> list[dict]:
    items = [(label, c) for label in shapes for c in prefill_space(label)]
    fa3 = fa3_paged_attention()
    compiled = precompile(run_prefill, items, pool)
    results = []
    for label in shapes:
        length, ctx, batch, heads, _, head_dim = PREFILL_SHAPES[label]
        # Query-key pairs: the causal half of the new block plus the whole prefix.
        tflop = 4 * batch * (length * length / 2 + length * ctx) * heads * head_dim / 1e9
        q = prefill_inputs(label)[0]
        default = prefill.pick_config(q, head_dim, length)
        want = run_prefill((label, default)).clone()
        runs = []
        for (shape, config), ok in zip(items, compiled):
            if not ok or shape != label:
                continue
            fn = partial(run_prefill, (label, config))
            prefill_inputs(label)[-1].fill_(float("nan"))  # the output buffer is shared
            error = (fn().float() - want.float()).abs().max().item()
            if not error <= 5e-2:  # compiles but computes wrong (NaN too): no candidate
                print(f"  {config}: max |diff| {error:.3f} from the default config", flush=True)
                continue
            runs.append((config, fn, tflop))
        rate = tflop / triton.testing.do_bench(partial(run_prefill, (label, default)))
        print(f"{label:<26} {rate:8.0f} TFLOP/s  default {default}", flush=True)
        if fa3 is not None:
            q, k, v, md, _, _, out = prefill_inputs(label)
            fa3_ms = triton.testing.do_bench(partial(fa3, q, k, v, md, head_dim**-0.5, out))
            print(f"{label:<26} {tflop / fa3_ms:8.0f} TFLOP/s  FA3 (vLLM's)", flush=True)
        for rate, config in best(label, runs, "TFLOP/s"):
            results.append({"shape": label, "TFLOP/s": rate, "config": config})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["decode", "prefill"])
    parser.add_argument("--shapes", nargs="+", choices=list(PREFILL_SHAPES),
                        default=list(PREFILL_SHAPES), help="prefill shapes to sweep")  # fmt: skip
    parser.add_argument("--json", help="write the prefill results (every config, per shape)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.only != "prefill":
        tune_decode()
    if args.only != "decode":
        with worker_pool() as pool:
            results = tune_prefill(args.shapes, pool)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
