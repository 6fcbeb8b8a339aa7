"""The launch search of benchmarks/w4a16.py --sweep, for one layer and M.

Candidates of ATOM's small-M W4A16 kernel (tile width, K splits, warps, stages), passed
through w4a16_gemm_triton's `config` override: each is checked against the reference, then
timed once as a graph replay; the fastest few and the default are timed again, taking turns
over five rounds, and the fastest of those is the winner. Every config left out is printed
with the reason.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

from atom.kernels.triton.w4a16 import SMALL_M, W4a16Config
from benchmarks.precompile import describe_error
from benchmarks.timing import H100_PEAK_GBPS, bench, graphed, interleaved

SWEEP_TOKENS = (1, SMALL_M)
# (block_n, num_warps, num_stages) tried at each K split, with a 128 K step (256 spilled
# registers in sm_90 builds with Triton 3.6 and 3.9); few enough that the sweep (4 layers,
# 2 M) compiles and times in about a minute on an H100.
SWEEP_LAUNCHES = (
    (32, 2, 3), (32, 4, 4),
    (64, 4, 3), (64, 4, 4), (64, 8, 4),
    (128, 4, 3), (128, 4, 4), (128, 8, 3), (128, 8, 4),
)  # fmt: skip
SWEEP_BLOCK_K = 128
FINALISTS = 3  # the fastest of one run each, timed again taking turns with the default
# A run's timer: (runs, rounds) -> each run's time in us.
Timer = Callable[[list[Callable], int], list[float]]


def sweep_configs(n: int, k: int, sms: int) -> list[W4a16Config]:
    """Small-M launches worth timing: each of SWEEP_LAUNCHES unsplit, and at every K split
    (up to 16, each split at least two K steps) that gives one to four programs per SM."""
    configs = []
    for block_n, warps, stages in SWEEP_LAUNCHES:
        tiles = -(-n // block_n)
        for split in (1, 2, 4, 8, 16):
            if split == 1 or (sms <= tiles * split <= 4 * sms and k >= 2 * split * SWEEP_BLOCK_K):
                configs.append(W4a16Config(SMALL_M, block_n, SWEEP_BLOCK_K, split, warps, stages))
    return configs


def describe(config: W4a16Config) -> str:
    return (
        f"n{config.block_n} k{config.block_k} split{config.split_k} "
        f"w{config.num_warps} s{config.num_stages}"
    )


def graph_replay_us(runs: list[Callable], rounds: int) -> list[float]:
    """Each run's median graph-replay time; over several rounds, the runs take turns. One
    round is a shorter run than benchmarks/w4a16.py's rows (the sweep times a few hundred
    candidates)."""
    graphs = [graphed(run) for run in runs]
    if rounds == 1:
        return [1e3 * bench(graph, warmup=5, rep=25) for graph in graphs]
    return [1e3 * statistics.median(t) for t in interleaved(graphs, rounds)]


def search(
    runs: dict[W4a16Config, Callable],
    default: W4a16Config,
    error_of: Callable,
    tolerance: float,
    weight_bytes: int,
    timer: Timer,
) -> dict:
    """{sweep: the configs that match (error_of(output) <= tolerance), fastest first;
    finals: the finalists' times taking turns, fastest first; rejected: the others}."""
    timed, rejected = [], []  # timed: (row, run)
    for config, run in runs.items():
        try:
            error = error_of(run())
            if error > tolerance:
                raise ValueError(f"off by {error:.3g}")
            (us,) = timer([run], 1)
        except Exception as exc:  # off, or a launch this GPU cannot build (shared memory)
            print(f"  rejected {describe(config)}: {describe_error(exc)}", flush=True)
            rejected.append(describe(config))
            continue
        row = {"config": describe(config), "default": config == default, "error": error}
        timed.append((row | _bandwidth(weight_bytes, us), run))
    timed.sort(key=lambda pair: pair[0]["us"])
    finalists = [pair for i, pair in enumerate(timed) if i < FINALISTS or pair[0]["default"]]
    times = timer([run for _, run in finalists], 5)
    finals = [
        {"config": row["config"], "default": row["default"]} | _bandwidth(weight_bytes, us)
        for (row, _), us in zip(finalists, times)
    ]
    finals.sort(key=lambda row: row["us"])
    return {"sweep": [row for row, _ in timed], "finals": finals, "rejected": rejected}


def _bandwidth(weight_bytes: int, us: float) -> dict:
    gbps = weight_bytes / us / 1e3
    return {"us": us, "GB/s": gbps, "peak_bw_fraction": gbps / H100_PEAK_GBPS}


def print_sweep(result: dict) -> None:
    name, fmt, m = result["layer"], result["format"], result["M"]
    print(f"sweep {name} {fmt} K={result['K']} N={result['N']} M={m}: fastest first "
          f"({len(result['rejected'])} rejected)")  # fmt: skip
    for title, rows in (
        ("one run each", result["sweep"]),
        ("finalists, 5 rounds", result["finals"]),
    ):
        print(f" {title}:")
        for row in rows:
            print(
                f"  {row['config']:<28} {row['us']:>8.1f} us {row['GB/s']:>7.0f} GB/s "
                f"{100 * row['peak_bw_fraction']:>4.0f}%{'  (default)' if row['default'] else ''}"
            )
    if finals := result["finals"]:
        default = next((row for row in finals if row["default"]), None)
        versus = f"default {default['config']}: {default['us']:.1f} us" if default else "no default"
        print(
            f"WINNER {name} {fmt} M={m}: {finals[0]['config']} {finals[0]['us']:.1f} us ({versus})"
        )
    print("SWEEP", json.dumps(result), flush=True)
