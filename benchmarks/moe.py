"""Fused-MoE benchmark on a CUDA GPU: one Qwen3-30B-A3B expert layer (128 experts, top-8,
hidden 2048, intermediate 768), bf16 and FP8 with 128x128 block scales.

Per row: median time (triton.testing.do_bench), TFLOP/s, GB/s of the expert weights the
routing touches, and their fractions of the H100 peak; vLLM's Triton fused_experts on the
same inputs when vllm is importable (as in shared/anchors/moe_anchor.py). Usage:
    PYTHONPATH=packages/atom-core/src:. python benchmarks/moe.py [--tokens 1 64]
        [--formats bf16] [--sweep [--workers 16]] [--json out.json]
--sweep also searches the tiles per row, in two phases: the gate_up GEMM's tiles (the down
GEMM tiled the same), then the down GEMM's with gate_up at its best. Each phase compiles
its configs in a pool of worker processes first (benchmarks/precompile.py), then times them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
from dataclasses import replace
from functools import partial

import torch
import triton

from atom.kernels.fp8 import quantize_fp8_per_block
from atom.kernels.moe import topk_softmax_torch
from atom.kernels.triton.fused_moe import GemmTiles, MoEConfig, fused_moe_triton, pick_config
from benchmarks.precompile import precompile, progress, worker_pool

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = [1, 64, 4096, 16384]
FORMATS = ("bf16", "fp8-block")
BLOCK = (128, 128)
PEAK_GBPS = 3350.0  # H100 SXM HBM3
PEAK_TFLOPS = {"bf16": 989.0, "fp8-block": 1979.0}  # H100 SXM dense


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 [E, N, K] and scales [E, N/128, K/128] (blocks never straddle experts)."""
    q, scale = quantize_fp8_per_block(w.reshape(-1, w.shape[-1]), BLOCK)
    return q.view_as(w), scale.view(w.shape[0], -1, scale.shape[-1])


@functools.lru_cache(maxsize=1)  # one format at a time: a sweep worker sees both
def expert_weights(fmt: str) -> dict:
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    if fmt == "bf16":
        return dict(w13=w13, w2=w2, w13_scale=None, w2_scale=None, block_size=None)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    return dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, block_size=BLOCK)


def layer_args(fmt: str, num_tokens: int) -> tuple:
    """fused_moe_triton's arguments for one row, the same in every process (seeded)."""
    w = expert_weights(fmt)
    torch.manual_seed(1)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda")
    topk_weights, topk_ids = topk_softmax_torch(logits, TOP_K, True)
    return (x, w["w13"], w["w2"], topk_weights, topk_ids, "silu",
            w["w13_scale"], w["w2_scale"], w["block_size"])  # fmt: skip


def vllm_runner(args: tuple):
    """vLLM's Triton fused_experts on the experts of `args` (layer_args), or None without
    vllm."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except ImportError:
        return None
    _, w13, w2, _, _, _, w13_scale, w2_scale, block_size = args
    kwargs = {}
    if block_size is not None:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        kwargs["quant_config"] = fp8_w8a8_moe_quant_config(
            w1_scale=w13_scale, w2_scale=w2_scale, block_shape=list(block_size)
        )
    config = VllmConfig()

    def run(x, topk_weights, topk_ids):
        with set_current_vllm_config(config):
            return fused_experts(x, w13, w2, topk_weights, topk_ids, **kwargs)

    return run


def tile_grid(space: dict) -> list[GemmTiles]:
    return [GemmTiles(**dict(zip(space, v))) for v in itertools.product(*space.values())]


def sweep_spaces(num_tokens: int, fp8: bool) -> tuple[list[int], dict, dict]:
    """(block_m values, gate_up tile space, down tile space). FP8 K-tiles must divide the
    128-wide scale blocks."""
    if num_tokens * TOP_K <= 16 * EXPERTS:  # every expert gets at most a few rows
        tiles = dict(block_n=[32, 64, 128], block_k=[64, 128] + ([] if fp8 else [256]),
                     group_m=[1], num_warps=[4], num_stages=[3, 4, 5])  # fmt: skip
        return [16], tiles, tiles
    gate_up = dict(block_n=[64, 128], block_k=[64, 128], group_m=[1, 8, 16],
                   num_warps=[4, 8], num_stages=[3, 4])  # fmt: skip
    # Only the down GEMM has one accumulator: a 256-wide N-tile would spill in the gated one.
    return [64, 128], gate_up, {**gate_up, "block_n": [64, 128, 256]}


def describe(config: MoEConfig) -> str:
    def tiles(t: GemmTiles) -> str:
        return f"n{t.block_n} k{t.block_k} group{t.group_m} w{t.num_warps} s{t.num_stages}"

    return f"block_m {config.block_m} | gate_up {tiles(config.gate_up)} | down {tiles(config.down)}"


def compile_config(item) -> None:
    """Sweep worker: one run of one config on the row's inputs compiles both GEMMs."""
    fmt, num_tokens, config = item
    fused_moe_triton(*layer_args(fmt, num_tokens), config=config)
    torch.cuda.synchronize()


def fastest(label: str, configs, fmt: str, args: tuple, pool) -> tuple[float, MoEConfig]:
    num_tokens = args[0].shape[0]
    items = [(fmt, num_tokens, config) for config in configs]
    ran = precompile(compile_config, items, pool, f"{label} compiled")
    runnable = [config for config, ok in zip(configs, ran) if ok]
    timed = []
    for done, config in enumerate(runnable, 1):
        with contextlib.suppress(Exception):  # a tile that exceeds this GPU's shared memory
            timed.append((bench(partial(fused_moe_triton, *args, config=config)), config))
        progress(f"{label} timed", done, len(runnable))
    if len(timed) < len(configs):
        print(f"  {label}: skipped {len(configs) - len(timed)} configs that failed", flush=True)
    return min(timed, key=lambda t: t[0])


def sweep(fmt: str, args: tuple, pool) -> dict:
    """The gate_up tiles first (down tiled the same), then the down tiles with gate_up and
    block_m fixed at their best."""
    num_tokens = args[0].shape[0]
    block_ms, gate_up_space, down_space = sweep_spaces(num_tokens, fmt != "bf16")
    label = f"{fmt} T={num_tokens}"
    same = [MoEConfig(m, t, t) for m in block_ms for t in tile_grid(gate_up_space)]
    gate_up_ms, gate_up_best = fastest(f"{label} gate_up", same, fmt, args, pool)
    downs = [replace(gate_up_best, down=t) for t in tile_grid(down_space)]
    best_ms, best = fastest(f"{label} down", downs, fmt, args, pool)
    return {"gate_up_best_ms": gate_up_ms, "gate_up_best_config": describe(gate_up_best),
            "best_ms": best_ms, "best_config": describe(best)}  # fmt: skip


def measure(fmt: str, num_tokens: int, pool) -> dict:
    args = layer_args(fmt, num_tokens)
    vllm = vllm_runner(args)
    x, w13, _, topk_weights, topk_ids, *_ = args
    ms = bench(partial(fused_moe_triton, *args))
    touched = int(torch.unique(topk_ids).numel())
    flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * INTER
    tflops = flops / ms / 1e9
    gbps = touched * w13.element_size() * 3 * HIDDEN * INTER / ms / 1e6
    default = pick_config(num_tokens * TOP_K, EXPERTS, INTER, x.dtype, fmt != "bf16", x.device)
    row = {"format": fmt, "T": num_tokens, "ms": ms, "TFLOP/s": tflops, "GB/s": gbps,
           "peak_flop_fraction": tflops / PEAK_TFLOPS[fmt], "peak_bw_fraction": gbps / PEAK_GBPS,
           "experts_touched": touched, "default_config": describe(default)}  # fmt: skip
    if vllm is not None:
        with contextlib.suppress(Exception):  # an API this vLLM version lacks
            row["vllm_ms"] = bench(partial(vllm, x, topk_weights, topk_ids))
            row["vllm_ratio"] = row["vllm_ms"] / ms
    if pool is not None:
        row.update(sweep(fmt, args, pool))
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
    if "best_config" in row:
        print(f"    default        {row['ms']:.4f} ms  {row['default_config']}")
        print(f"    best gate_up   {row['gate_up_best_ms']:.4f} ms  {row['gate_up_best_config']}")
        print(f"    best combined  {row['best_ms']:.4f} ms  {row['best_config']}")
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
