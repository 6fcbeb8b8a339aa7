"""Fused-MoE benchmark on a CUDA GPU: one Qwen3-30B-A3B expert layer (128 experts, top-8,
hidden 2048, intermediate 768), bf16 and FP8 with 128x128 block scales.

Per row: time, TFLOP/s, GB/s of the expert weights the routing touches, and their fractions
of the H100 peak; vLLM's Triton fused_experts on the same inputs when vllm is importable (as
in shared/anchors/moe_anchor.py). ATOM and vLLM take turns over five rounds (medians, and
the median of the rounds' ratios): back-to-back runs drifted by up to 15%. Usage:
    PYTHONPATH=packages/atom-core/src:. python benchmarks/moe.py [--tokens 1 64]
        [--formats bf16] [--sweep [--workers 16]] [--json out.json]
--sweep also searches the tiles per row (benchmarks/moe_sweep.py); the best config, and at
large T the best with its gate/up form flipped, then take turns with the default and vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from functools import partial

import torch

from atom.kernels.moe import fused_moe_torch
from atom.kernels.triton.fused_moe import fused_moe_triton, pick_config
from benchmarks.moe_layer import (
    EXPERTS,
    HIDDEN,
    INTER,
    TOP_K,
    describe,
    layer_args,
    mismatch,
    nan_filled_allocations,
)
from benchmarks.moe_sweep import sweep
from benchmarks.precompile import worker_pool
from benchmarks.timing import H100_PEAK_GBPS, H100_PEAK_TFLOPS, interleaved, median_ratio

TOKENS = [1, 64, 4096, 16384]
FORMATS = ("bf16", "fp8-block")


def vllm_runner(args: tuple):
    """vLLM's Triton fused_experts on the inputs of `args` (layer_args) as a function of no
    arguments, or None without vllm (or with a vllm whose API differs)."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except ImportError:
        return None
    x, w13, w2, topk_weights, topk_ids, _, w13_scale, w2_scale, block_size = args
    kwargs = {}
    if block_size is not None:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        kwargs["quant_config"] = fp8_w8a8_moe_quant_config(
            w1_scale=w13_scale, w2_scale=w2_scale, block_shape=list(block_size)
        )
    config = VllmConfig()

    def run():
        with set_current_vllm_config(config):
            return fused_experts(x, w13, w2, topk_weights, topk_ids, **kwargs)

    try:
        run()
    except Exception as exc:  # an API this vLLM version lacks
        print(f"  vLLM fused_experts failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    return run


def measure(fmt: str, num_tokens: int, pool) -> dict:
    args = layer_args(fmt, num_tokens)
    x, w13, _, _, topk_ids, *_ = args
    fp8 = fmt != "bf16"
    want = fused_moe_torch(*args)
    default = pick_config(num_tokens * TOP_K, EXPERTS, INTER, x.dtype, fp8, x.device)
    row = {"format": fmt, "T": num_tokens, "default_config": describe(default)}
    with nan_filled_allocations():  # as the sweep's candidates are checked
        error = mismatch(fused_moe_triton(*args), want, fp8)
    if error is not None:
        print(f"  {fmt} T={num_tokens}: the default config's output differs: {error}", flush=True)
        row["default_mismatch"] = error
    runs = {"ms": partial(fused_moe_triton, *args)}
    vllm = vllm_runner(args)
    if vllm is not None:
        runs["vllm_ms"] = vllm
    contenders = {}
    if pool is not None:
        fields, contenders = sweep(fmt, args, want, pool)
        row.update(fields)
        runs.update({f"{name}_ms": partial(fused_moe_triton, *args, config=config)
                     for name, config in contenders.items()})  # fmt: skip
    times = dict(zip(runs, interleaved(list(runs.values()))))
    row.update({name: statistics.median(t) for name, t in times.items()})
    for name in contenders:  # above 1.0: faster than the default
        row[f"{name}_speedup"] = median_ratio(times["ms"], times[f"{name}_ms"])
    if "flipped" in contenders:
        stacked, pair = (
            ("best", "flipped") if contenders["best"].gate_up.stacked else ("flipped", "best")
        )
        row["stacked_speedup"] = median_ratio(times[f"{pair}_ms"], times[f"{stacked}_ms"])
    if vllm is not None:  # above 1.0: ATOM faster
        for name in times.keys() - {"vllm_ms"}:
            row[name.replace("ms", "vllm_ratio")] = median_ratio(times["vllm_ms"], times[name])
    ms = row["ms"]
    touched = int(torch.unique(topk_ids).numel())
    tflops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTER / ms / 1e9
    gbps = touched * w13.element_size() * 3 * HIDDEN * INTER / ms / 1e6
    peak_tflops = H100_PEAK_TFLOPS["fp8" if fp8 else "bf16"]
    row.update({"TFLOP/s": tflops, "GB/s": gbps, "peak_flop_fraction": tflops / peak_tflops,
                "peak_bw_fraction": gbps / H100_PEAK_GBPS, "experts_touched": touched})  # fmt: skip
    return row


def rows(tokens: list[int], formats: list[str], pool):
    for fmt in formats:
        for num_tokens in tokens:
            yield measure(fmt, num_tokens, pool)


def print_row(row: dict) -> None:
    vllm_ms, ratio = row.get("vllm_ms"), row.get("vllm_ratio")
    print(
        f"{row['format']:>9} {row['T']:>6} {row['ms']:>8.4f} {row['TFLOP/s']:>8.1f} "
        f"{row['GB/s']:>7.0f} {100 * row['peak_flop_fraction']:>5.1f}% "
        f"{100 * row['peak_bw_fraction']:>4.0f}% "
        + (f"{vllm_ms:>8.4f} {ratio:>9.2f}" if vllm_ms else f"{'-':>8} {'-':>9}")
    )
    if "sweep_error" in row:
        print(f"    sweep: {row['sweep_error']}")
    if "best_config" in row:
        print(f"    default   {row['ms']:.4f} ms  {row['default_config']}")
        for form in ("pair", "stacked"):
            if best := row.get(f"gate_up_best_{form}"):
                print(f"    gate_up {form} (sweep) {best['ms']:.4f} ms  {best['config']}")
        for name in ("best", "flipped"):
            if f"{name}_ms" in row:
                vllm = f", vLLM/this {row[f'{name}_vllm_ratio']:.3f}" if vllm_ms else ""
                print(f"    {name:<9} {row[f'{name}_ms']:.4f} ms (default/this "
                      f"{row[f'{name}_speedup']:.3f}{vllm})  {row[f'{name}_config']}")  # fmt: skip
        if "stacked_speedup" in row:
            print(f"    stacked over pair, same tiles: {row['stacked_speedup']:.3f}x")
    print("RESULT", json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--sweep", action="store_true", help="also search the tiles per row")
    parser.add_argument("--workers", type=int, help="sweep compile processes (default <= 16)")
    parser.add_argument("--json", help="write all rows to this file")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"{device}: E={EXPERTS} top-{TOP_K} H={HIDDEN} I={INTER}")
    header = f"{'format':>9} {'T':>6} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'%flop':>6} {'%bw':>5}"
    print(header + f" {'vLLM ms':>8} {'vLLM/ATOM':>9}")
    all_rows = []
    with worker_pool(args.workers) if args.sweep else contextlib.nullcontext() as pool:
        for row in rows(args.tokens, args.formats, pool):
            print_row(row)
            all_rows.append(row)
            if args.json:  # after every row: a sweep cut off by a time limit keeps the rest
                with open(args.json, "w") as f:
                    json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
