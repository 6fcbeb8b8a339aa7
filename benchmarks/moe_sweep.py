"""The tile search of benchmarks/moe.py --sweep, for one row (format and token count).

Two phases: the gate_up GEMM's tiles (the down GEMM tiled the same; at large T both the
two-dot and the stacked gate/up form), then the down GEMM's with gate_up at its best. Each
phase compiles its configs in a pool of worker processes first (benchmarks/precompile.py),
checks each one's output against the torch reference, then times the ones that match.
Every config left out on the way is printed with the reason.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial

import torch

from atom.kernels.triton.fused_moe import GemmTiles, MoEConfig, fused_moe_triton
from benchmarks.moe_layer import (
    EXPERTS,
    TOP_K,
    describe,
    layer_args,
    mismatch,
    nan_filled_allocations,
)
from benchmarks.precompile import describe_error, precompile, progress
from benchmarks.timing import bench


def tile_grid(space: dict) -> list[GemmTiles]:
    return [GemmTiles(**dict(zip(space, v))) for v in itertools.product(*space.values())]


def fits(block_m: int, tiles: GemmTiles, gated: bool, operand_bytes: int) -> bool:
    """Whether a GEMM's tiles can run well here: every stage's A and B tiles in shared
    memory (Triton refuses more), and at most 128 fp32 accumulators a thread (the gated
    128x128 tile at eight warps holds 128 and already uses all 255 registers on sm_90)."""
    width = tiles.block_n * (2 if gated else 1)  # gate and up columns
    stage = (block_m + width) * tiles.block_k * operand_bytes
    smem = torch.cuda.get_device_properties().shared_memory_per_block_optin
    return tiles.num_stages * stage <= smem and block_m * width <= 128 * 32 * tiles.num_warps


def sweep_spaces(num_tokens: int, fp8: bool) -> tuple[list[int], dict, dict]:
    """(block_m values, gate_up tile space, down tile space). FP8 K-tiles must divide the
    128-wide scale blocks."""
    if num_tokens * TOP_K <= 16 * EXPERTS:  # every expert gets at most a few rows
        tiles = dict(block_n=[32, 64, 128], block_k=[64, 128] + ([] if fp8 else [256]),
                     group_m=[1], num_warps=[4], num_stages=[3, 4, 5])  # fmt: skip
        return [16], tiles, tiles
    gate_up = dict(block_n=[64, 128], block_k=[64, 128], group_m=[1, 8],
                   num_warps=[4, 8], num_stages=[3, 4])  # fmt: skip
    # The gated tile is 2 x block_n wide (one accumulator stacked, two of block_n apart), so
    # a 256-wide N-tile would spill there: only the down GEMM tries it.
    down = {**gate_up, "block_n": [64, 128, 256]}
    return [64, 128], {**gate_up, "stacked": [False, True]}, down


def compile_config(item) -> None:
    """Sweep worker: one run of one config on the row's inputs compiles both GEMMs."""
    fmt, num_tokens, config = item
    fused_moe_triton(*layer_args(fmt, num_tokens), config=config)


def checked(label: str, configs: list[MoEConfig], fmt: str, args: tuple, want) -> list:
    """The configs whose output matches the reference (want), each with its run function."""
    runs, rejected = [], 0
    for config in configs:
        run = partial(fused_moe_triton, *args, config=config)
        try:
            with nan_filled_allocations():
                error = mismatch(run(), want, fmt != "bf16")
        except Exception as exc:  # a tile that exceeds this GPU's resources
            error = describe_error(exc)
        if error is None:
            runs.append((config, run))
        else:
            rejected += 1
            print(f"  {label}: rejected {describe(config)}: {error}", flush=True)
    if rejected:
        print(f"  {label}: rejected {rejected} of {len(configs)} configs", flush=True)
    return runs


def fastest(label: str, configs, fmt: str, args: tuple, want, pool) -> list[tuple]:
    """(sweep ms, config) of the configs that compile, match and time, fastest first (empty
    when none does)."""
    num_tokens = args[0].shape[0]
    ran = precompile(compile_config, [(fmt, num_tokens, c) for c in configs], pool, label)
    runs = checked(label, [c for c, ok in zip(configs, ran) if ok], fmt, args, want)
    timed = []
    for done, (config, run) in enumerate(runs, 1):
        try:
            timed.append((bench(run, warmup=10, rep=50), config))
        except Exception as exc:
            print(f"  {label}: rejected {describe(config)}: {describe_error(exc)}", flush=True)
        progress(f"{label} timed", done, len(runs))
    print(f"  {label}: {len(timed)} of {len(configs)} configs timed", flush=True)
    return sorted(timed, key=lambda t: t[0])


def sweep(fmt: str, args: tuple, want, pool) -> tuple[dict, dict[str, MoEConfig]]:
    """The gate_up tiles first (down tiled the same), then the down tiles with gate_up and
    block_m fixed at their best. Returns the row's sweep fields and the configs to time
    against the default: the best, and the best with its gate/up form flipped (none, and
    the fields' sweep_error, when a phase has no config left)."""
    num_tokens = args[0].shape[0]
    operand_bytes = 2 if fmt == "bf16" else 1
    block_ms, gate_up_space, down_space = sweep_spaces(num_tokens, fmt != "bf16")
    label = f"{fmt} T={num_tokens}"

    def nothing_left(fields: dict, phase: str) -> tuple[dict, dict]:
        error = f"no {phase} config ran and matched the reference"
        print(f"  {label}: {error}; the sweep stops", flush=True)
        return {**fields, "sweep_error": error}, {}

    space = [MoEConfig(m, t, t) for m in block_ms for t in tile_grid(gate_up_space)]
    same = [c for c in space if fits(c.block_m, c.gate_up, True, operand_bytes)]
    print(f"  {label}: {len(same)} of {len(space)} gate_up configs fit", flush=True)
    gate_up_timed = fastest(f"{label} gate_up", same, fmt, args, want, pool)
    if not gate_up_timed:
        return nothing_left({}, "gate_up")
    fields = {}
    for stacked in gate_up_space.get("stacked", [False]):
        form = [t for t in gate_up_timed if t[1].gate_up.stacked == stacked]
        if form:
            key = "stacked" if stacked else "pair"
            fields[f"gate_up_best_{key}"] = {"ms": form[0][0], "config": describe(form[0][1])}
    gate_up_best = gate_up_timed[0][1]
    downs = [replace(gate_up_best, down=t) for t in tile_grid(down_space)]
    downs = [c for c in downs if fits(c.block_m, c.down, False, operand_bytes)]
    down_timed = fastest(f"{label} down", downs, fmt, args, want, pool)
    if not down_timed:
        return nothing_left(fields, "down")
    best_ms, best = down_timed[0]
    fields.update(best_sweep_ms=best_ms, best_config=describe(best))
    contenders = {"best": best}
    if "stacked" in gate_up_space:
        flipped = replace(best, gate_up=replace(best.gate_up, stacked=not best.gate_up.stacked))
        if checked(f"{label} flipped", [flipped], fmt, args, want):
            contenders["flipped"] = flipped
            fields["flipped_config"] = describe(flipped)
    return fields, contenders
