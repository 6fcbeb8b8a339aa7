"""Fused-MoE benchmark on a CUDA GPU: one Qwen3-30B-A3B expert layer (128 experts, top-8,
hidden 2048, intermediate 768), bf16 and FP8 with 128x128 block scales; and one gpt-oss-20b
expert layer (32 experts, top-4, hidden and intermediate 2880, biases, clamped SwiGLU) in
MXFP4 (format "mxfp4": weights packed, bf16 activations).

Per row: time, TFLOP/s, GB/s of the expert weights the routing touches, and their fractions
of the H100 peak; vLLM's Triton fused_experts on the same inputs when vllm is importable (as
in shared/anchors/moe_anchor.py). For MXFP4 the peer is vLLM's GPT-OSS MXFP4 path on Hopper
(triton_kernels' matmul_ogs, "TRITON" backend), which routes inside its call: both sides
are timed from the router logits (ATOM: topk_softmax, then fused_moe_mxfp4). ATOM and vLLM
take turns over five rounds (medians, and the median of the rounds' ratios), because the
GPU's clock drifts between back-to-back runs (docs/performance.md, "GPU clock drift"). Usage:
    PYTHONPATH=packages/atom-core/src:. python benchmarks/moe.py [--tokens 1 64]
        [--formats bf16] [--sweep [--workers 16]] [--json out.json]
--sweep also searches the tiles per row (benchmarks/moe_sweep.py; not MXFP4); the best
config, and at large T the best with its gate/up form flipped, then take turns with the
default and vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from functools import partial

import torch

from atom.kernels.activation import ClampedSwiGLU
from atom.kernels.moe import fused_moe_torch, topk_softmax_torch
from atom.kernels.moe_mxfp4 import fused_moe_mxfp4_torch
from atom.kernels.triton.fused_moe import fused_moe_triton, pick_config
from atom.kernels.triton.fused_moe_mxfp4 import fused_moe_mxfp4_triton, pick_mxfp4_config
from atom.kernels.triton.moe_routing import topk_softmax_triton
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
FORMATS = ("bf16", "fp8-block", "mxfp4")
# gpt-oss-20b's expert layer (the MXFP4 rows).
GPT_OSS_EXPERTS, GPT_OSS_TOP_K, GPT_OSS_HIDDEN, GPT_OSS_INTER = 32, 4, 2880, 2880
GPT_OSS_SWIGLU = ClampedSwiGLU(1.702, 7.0)


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


def mxfp4_layer(num_tokens: int) -> tuple[tuple, torch.Tensor]:
    """(fused_moe_mxfp4's arguments but the routing, router logits), seeded: random packed
    codes with scales near 2^-5, as trained GPT-OSS experts have (speed ignores values)."""
    torch.manual_seed(0)
    e, h, i = GPT_OSS_EXPERTS, GPT_OSS_HIDDEN, GPT_OSS_INTER

    def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device="cuda")
        return blocks, torch.randint(120, 124, (e, n, k // 32), dtype=torch.uint8, device="cuda")

    (b13, s13), (b2, s2) = packed(2 * i, h), packed(h, i)
    bias13 = torch.randn(e, 2 * i, device="cuda", dtype=torch.bfloat16) * 0.1
    bias2 = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.1
    torch.manual_seed(1)
    x = torch.randn(num_tokens, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, e, device="cuda")
    return (x, b13, s13, b2, s2, GPT_OSS_SWIGLU, bias13, bias2), logits


def vllm_mxfp4_runner(experts: tuple, logits: torch.Tensor):
    """vLLM's MXFP4 MoE for GPT-OSS on Hopper (triton_kernels, weights swizzled as vLLM's
    TRITON backend does at load) from the router logits, or None where it is unavailable."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.config import mxfp4_w4a16_moe_quant_config
        from vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe import (
            triton_kernel_moe_forward,
        )
        from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import FlexCtx, PrecisionConfig
        from vllm.model_executor.layers.quantization.utils.mxfp4_utils import (
            _swizzle_mxfp4,
            mx_scale_kwargs,
        )
    except ImportError as exc:
        print(f"  vLLM MXFP4 path unavailable: {exc}", flush=True)
        return None
    x, b13, s13, b2, s2, act, bias13, bias2 = experts

    def gate_up_interleaved(t: torch.Tensor) -> torch.Tensor:
        """ATOM's gate rows, then up rows -> GPT-OSS's (and vLLM's) gate, up, gate, ..."""
        gate, up = t.chunk(2, dim=1)
        return torch.stack([gate, up], dim=2).flatten(1, 2).contiguous()

    config = VllmConfig()
    try:
        with set_current_vllm_config(config):
            precision = []
            weights = []
            for blocks, scales in ((gate_up_interleaved(b13), gate_up_interleaved(s13)), (b2, s2)):
                w, flex, scale = _swizzle_mxfp4(blocks.flatten(-2), scales)
                weights.append(w)
                precision.append(
                    PrecisionConfig(**mx_scale_kwargs(scale), flex_ctx=FlexCtx(rhs_data=flex))
                )
            quant = mxfp4_w4a16_moe_quant_config(
                w1_scale=precision[0], w2_scale=precision[1],
                w1_bias=gate_up_interleaved(bias13).float(), w2_bias=bias2.float(),
                gemm1_alpha=act.alpha, gemm1_beta=1.0, gemm1_clamp_limit=act.limit,
            )  # fmt: skip

        def run():
            with set_current_vllm_config(config):
                return triton_kernel_moe_forward(
                    x, weights[0], weights[1], logits, GPT_OSS_TOP_K, renormalize=True,
                    quant_config=quant,
                )  # fmt: skip

        run()
    except Exception as exc:  # an API this vLLM version lacks
        print(f"  vLLM MXFP4 MoE failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    return run


def measure_mxfp4(num_tokens: int) -> dict:
    experts, logits = mxfp4_layer(num_tokens)
    x = experts[0]
    weights, ids = topk_softmax_torch(logits, GPT_OSS_TOP_K, True)
    want = fused_moe_mxfp4_torch(*experts[:5], weights, ids, *experts[5:])
    default = pick_mxfp4_config(
        num_tokens * GPT_OSS_TOP_K, GPT_OSS_EXPERTS, GPT_OSS_INTER, x.dtype, x.device
    )
    row = {"format": "mxfp4", "T": num_tokens, "default_config": describe(default)}

    def atom():
        weights, ids = topk_softmax_triton(logits, GPT_OSS_TOP_K, True)
        return fused_moe_mxfp4_triton(*experts[:5], weights, ids, *experts[5:])

    with nan_filled_allocations():
        error = mismatch(atom(), want, fp8=False)
    if error is not None:
        print(f"  mxfp4 T={num_tokens}: the default config's output differs: {error}", flush=True)
        row["default_mismatch"] = error
    runs = {"ms": atom}
    vllm = vllm_mxfp4_runner(experts, logits)
    if vllm is not None:
        runs["vllm_ms"] = vllm
        row["vllm_mismatch"] = mismatch(vllm(), want, fp8=False)
    times = dict(zip(runs, interleaved(list(runs.values()))))
    row.update({name: statistics.median(t) for name, t in times.items()})
    if vllm is not None:  # above 1.0: ATOM faster
        row["vllm_ratio"] = median_ratio(times["vllm_ms"], times["ms"])
    ms = row["ms"]
    touched = int(torch.unique(ids).numel())
    per_expert_bytes = 3 * GPT_OSS_HIDDEN * GPT_OSS_INTER * (0.5 + 1 / 32)  # codes + scales
    tflops = 2 * num_tokens * GPT_OSS_TOP_K * 3 * GPT_OSS_HIDDEN * GPT_OSS_INTER / ms / 1e9
    gbps = touched * per_expert_bytes / ms / 1e6
    row.update({"TFLOP/s": tflops, "GB/s": gbps,
                "peak_flop_fraction": tflops / H100_PEAK_TFLOPS["bf16"],
                "peak_bw_fraction": gbps / H100_PEAK_GBPS, "experts_touched": touched})  # fmt: skip
    return row


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
            yield measure_mxfp4(num_tokens) if fmt == "mxfp4" else measure(fmt, num_tokens, pool)


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
    print(
        f"{device}: E={EXPERTS} top-{TOP_K} H={HIDDEN} I={INTER} (mxfp4: gpt-oss-20b, "
        f"E={GPT_OSS_EXPERTS} top-{GPT_OSS_TOP_K} H={GPT_OSS_HIDDEN} I={GPT_OSS_INTER})"
    )
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
