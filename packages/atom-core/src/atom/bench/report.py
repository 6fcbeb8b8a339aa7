"""The bench's results as a table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

COLUMNS = [
    "shape", "engine", "requests", "input", "output", "out tok/s", "GB/s", "total tok/s", "ratio",
]  # fmt: skip
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; past 30, the normal's.
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def add_ratios(results: list[dict], baseline: str) -> None:
    """ratio = output tok/s / the baseline engine's on the same shape and workload."""
    base = {
        (r["shape"], r["workload"]): r["output_tok_s"]
        for r in results
        if r["engine"] == baseline and "output_tok_s" in r
    }
    for r in results:
        reference = base.get((r["shape"], r["workload"]))
        r["ratio"] = r["output_tok_s"] / reference if reference and "output_tok_s" in r else None


def median_run(runs: list[dict]) -> dict:
    """The run with the median output tok/s; for an even count the slower of the middle
    two, so the figure is always one that a run reached."""
    return sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]


def paired_ratio(ratios: list[float]) -> tuple[float, float, float] | None:
    """The geometric mean of per-round ratios and its 95% interval (t on the logs), or None
    for fewer than two rounds. Both engines of a round run back to back, so the host's
    drift over a long run mostly cancels within the pair."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    df = len(logs) - 1
    half = (T95[df - 1] if df <= len(T95) else 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def median_rounds(rounds: list[list[dict]], baseline: str) -> list[dict]:
    """One row per shape, engine and workload out of several rounds: the round with the
    median output tok/s, with every round's figure, its ratio to the baseline's figure
    of the same round, and those ratios' `paired_ratio` (geometric mean and 95% interval).
    A workload that failed in any round stays a failed row."""
    runs: dict[tuple, list[dict]] = {}
    for rows in rounds:
        add_ratios(rows, baseline)
        for r in rows:
            runs.setdefault((r["shape"], r["engine"], r["workload"]), []).append(r)
    merged = []
    for same in runs.values():
        failed = [r for r in same if "output_tok_s" not in r]
        if failed:
            merged.append(failed[0])
            continue
        row = dict(median_run(same))
        row["output_tok_s_rounds"] = [r["output_tok_s"] for r in same]
        row["ratio_rounds"] = [r["ratio"] for r in same]
        if row["engine"] != baseline and None not in row["ratio_rounds"]:
            row["paired_ratio"] = paired_ratio(row["ratio_rounds"])
        merged.append(row)
    return merged


def _row(r: dict, by_round: bool, speculative: bool) -> list[str]:
    numbers = (
        [f"{r['output_tok_s']:,.1f}", _gb_s(r.get("gb_s")), f"{r['total_tok_s']:,.1f}"]
        if "output_tok_s" in r
        else ["failed", "-", "-"]
    )
    ratio = _ratio(r.get("ratio"))
    return (
        [
            r["shape"],
            r["engine"],
            str(r["num_prompts"]),
            str(r["input_len"]),
            str(r["output_len"]),
            *numbers,
            ratio,
        ]
        + (
            [_paired(r.get("paired_ratio")), " ".join(_ratio(x) for x in r.get("ratio_rounds", []))]
            if by_round
            else []
        )
        + (
            [_ratio(r.get("mean_accepted_length")), _ratio(r.get("acceptance_rate"))]
            if speculative
            else []
        )
    )


def _gb_s(value: float | None) -> str:
    """GB/s of weight and KV reads (atom.bench.traffic); "-" for a shape without a model."""
    return "-" if value is None else f"{value:,.2f}"


def _paired(value: tuple[float, float, float] | None) -> str:
    return "-" if value is None else f"{value[0]:.3f} ({value[1]:.3f}-{value[2]:.3f})"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(results: list[dict], baseline: str) -> str:
    by_round = any("ratio_rounds" in r for r in results)
    header = [*COLUMNS[:-1], f"ratio vs {baseline}"]
    header += ["paired ratio (95% CI)", "ratio by round"] if by_round else []
    speculative = any("mean_accepted_length" in r for r in results)
    header += ["tokens/verify step", "acceptance"] if speculative else []
    rows = [header] + [_row(r, by_round, speculative) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, settings: dict, results: list[dict], agreement: list[dict]) -> None:
    body = {"settings": settings, "results": results, "greedy_agreement": agreement}
    path.write_text(json.dumps(body, indent=2) + "\n")


def write_plot(path: Path, results: list[dict], baseline: str) -> str | None:
    """Output tok/s per workload, one bar per engine, one panel per shape; returns why
    no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written"
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    engines = list(dict.fromkeys(r["engine"] for r in results))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    width = 0.8 / len(engines)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in results if r["shape"] == shape]
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        for j, engine in enumerate(engines):
            by_workload = {r["workload"]: r for r in rows if r["engine"] == engine}
            xs = [i + (j - (len(engines) - 1) / 2) * width for i in range(len(workloads))]
            ys = [by_workload.get(w, {}).get("output_tok_s", 0.0) for w in workloads]
            bars = ax.bar(xs, ys, width, label=engine)
            for bar, w in zip(bars, workloads):
                ratio = by_workload.get(w, {}).get("ratio")
                if ratio is not None and engine != baseline:
                    ax.annotate(
                        f"{ratio:.2f}x",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_ylabel("output tokens/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"atom bench (ratios vs {baseline})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
