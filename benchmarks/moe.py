"""Fused-MoE benchmark on a CUDA GPU: one Qwen3-30B-A3B expert layer (128 experts, top-8,
hidden 2048, intermediate 768), bf16 and FP8 with 128x128 block scales.

Per row: median time (triton.testing.do_bench), TFLOP/s, GB/s of the expert weights the
routing touches, and their fractions of the H100 peak; vLLM's Triton fused_experts on the
same inputs when vllm is importable (as in shared/anchors/moe_anchor.py). Usage:
    PYTHONPATH=packages/atom-core/src python benchmarks/moe.py [--tokens 1 64] [--sweep]
        [--json out.json]
--sweep also times a set of tile configs per row and prints the fastest (compiles each).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
from functools import partial

import torch
import triton

from atom.kernels.fp8 import quantize_fp8_per_block
from atom.kernels.moe import topk_softmax_torch
from atom.kernels.triton.fused_moe import MoEConfig, fused_moe_triton

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = [1, 64, 4096, 16384]
BLOCK = (128, 128)
PEAK_GBPS = 3350.0  # H100 SXM HBM3
PEAK_TFLOPS = {"bf16": 989.0, "fp8-block": 1979.0}  # H100 SXM dense


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 [E, N, K] and scales [E, N/128, K/128] (blocks never straddle experts)."""
    q, scale = quantize_fp8_per_block(w.reshape(-1, w.shape[-1]), BLOCK)
    return q.view_as(w), scale.view(w.shape[0], -1, scale.shape[-1])


def expert_weights(fmt: str) -> dict:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    if fmt == "bf16":
        return dict(w13=w13, w2=w2, w13_scale=None, w2_scale=None, block_size=None)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    return dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, block_size=BLOCK)


def vllm_runner(weights: dict):
    """vLLM's Triton fused_experts on the same weights, or None without vllm."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except ImportError:
        return None
    kwargs = {}
    if weights["block_size"] is not None:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        kwargs["quant_config"] = fp8_w8a8_moe_quant_config(
            w1_scale=weights["w13_scale"],
            w2_scale=weights["w2_scale"],
            block_shape=list(weights["block_size"]),
        )
    config = VllmConfig()

    def run(x, topk_weights, topk_ids):
        with set_current_vllm_config(config):
            return fused_experts(x, weights["w13"], weights["w2"], topk_weights, topk_ids, **kwargs)

    return run


def sweep_configs(num_tokens: int, fp8: bool):
    # FP8 K tiles must divide the 128-wide scale blocks.
    if num_tokens * TOP_K <= 16 * EXPERTS:  # every expert gets at most a few rows
        block_ks = [128] if fp8 else [128, 256]
        shapes = itertools.product([16], [32, 64, 128], block_ks, [1], [4], [3, 4, 5])
    else:
        block_ks = [128] if fp8 else [64, 128]
        shapes = itertools.product([64, 128], [128, 256], block_ks, [8], [4, 8], [3, 4])
    return [MoEConfig(*s) for s in shapes]


def time_config(args, config) -> float | None:
    try:
        return bench(partial(fused_moe_triton, *args, config=config))
    except Exception:  # a tile that exceeds shared memory or registers on this GPU
        return None


def measure(fmt: str, weights: dict, vllm, num_tokens: int, sweep: bool) -> dict:
    torch.manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda")
    topk_weights, topk_ids = topk_softmax_torch(logits, TOP_K, True)
    args = (x, weights["w13"], weights["w2"], topk_weights, topk_ids, "silu",
            weights["w13_scale"], weights["w2_scale"], weights["block_size"])  # fmt: skip
    ms = bench(partial(fused_moe_triton, *args))
    touched = int(torch.unique(topk_ids).numel())
    flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTER
    tflops = flops / ms / 1e9
    gbps = touched * weights["w13"].element_size() * 3 * HIDDEN * INTER / ms / 1e6
    row = {"format": fmt, "T": num_tokens, "ms": ms, "TFLOP/s": tflops, "GB/s": gbps,
           "peak_flop_fraction": tflops / PEAK_TFLOPS[fmt], "peak_bw_fraction": gbps / PEAK_GBPS,
           "experts_touched": touched}  # fmt: skip
    if vllm is not None:
        with contextlib.suppress(Exception):  # an API this vLLM version lacks
            row["vllm_ms"] = bench(partial(vllm, x, topk_weights, topk_ids))
            row["vllm_ratio"] = row["vllm_ms"] / ms
    if sweep:
        timed = [(time_config(args, c), c) for c in sweep_configs(num_tokens, fmt != "bf16")]
        best_ms, best = min((t, c) for t, c in timed if t is not None)
        row["best_ms"], row["best_config"] = best_ms, str(best)
    return row


def rows(tokens: list[int], sweep: bool):
    for fmt in ("bf16", "fp8-block"):
        weights = expert_weights(fmt)
        vllm = vllm_runner(weights)
        for num_tokens in tokens:
            yield measure(fmt, weights, vllm, num_tokens, sweep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--sweep", action="store_true", help="also time tile configs per row")
    parser.add_argument("--json", help="write all rows to this file")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"{device}: E={EXPERTS} top-{TOP_K} H={HIDDEN} I={INTER}")
    header = f"{'format':>9} {'T':>6} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'%flop':>6} {'%bw':>5}"
    print(header + f" {'vLLM ms':>8} {'vLLM/ATOM':>9}")
    all_rows = []
    for row in rows(args.tokens, args.sweep):
        vllm_ms, ratio = row.get("vllm_ms"), row.get("vllm_ratio")
        print(
            f"{row['format']:>9} {row['T']:>6} {row['ms']:>8.4f} {row['TFLOP/s']:>8.1f} "
            f"{row['GB/s']:>7.0f} {100 * row['peak_flop_fraction']:>5.1f}% "
            f"{100 * row['peak_bw_fraction']:>4.0f}% "
            + (f"{vllm_ms:>8.4f} {ratio:>9.2f}" if vllm_ms else f"{'-':>8} {'-':>9}")
        )
        if "best_config" in row:
            print(f"          best tile: {row['best_config']} {row['best_ms']:.4f} ms")
        print("RESULT", json.dumps(row), flush=True)
        all_rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
