"""Latency and throughput against request rate, one line per engine (PNG, matplotlib)."""

from __future__ import annotations

from pathlib import Path

from atom.bench.serve.report import ordered

# (title, row field, statistic or None for a plain number)
PANELS = (
    ("TTFT p50 (ms)", "ttft_ms", "p50"),
    ("TTFT p99 (ms)", "ttft_ms", "p99"),
    ("TPOT p50 (ms)", "tpot_ms", "p50"),
    ("output tokens/s", "output_throughput", None),
    ("failed requests", "failed", None),
)


def _value(row: dict, field: str, stat: str | None) -> float:
    value = row.get(field)
    if value is None:
        return float("nan")  # a failed run leaves a gap in its line
    return value[stat] if stat else value


def write_plot(path: Path, rows: list[dict]) -> str | None:
    """One row of panels per model and workload, rates evenly spaced on x (inf last);
    returns why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 'plot skipped: matplotlib is not installed (pip install "atom-core[bench]")'
    rows = ordered(rows)
    groups = list(dict.fromkeys((r["model"], r["workload"]) for r in rows))
    fig, axes = plt.subplots(
        len(groups), len(PANELS), figsize=(4.2 * len(PANELS), 3.4 * len(groups)), squeeze=False
    )
    for axes_row, (model, workload) in zip(axes, groups):
        group = [r for r in rows if (r["model"], r["workload"]) == (model, workload)]
        rates = sorted({r["rate"] for r in group}, key=float)
        engines = list(dict.fromkeys(r["engine"] for r in group))
        for ax, (title, field, stat) in zip(axes_row, PANELS):
            for engine in engines:
                by_rate = {r["rate"]: r for r in group if r["engine"] == engine}
                ys = [
                    _value(by_rate[x], field, stat) if x in by_rate else float("nan") for x in rates
                ]
                ax.plot(range(len(rates)), ys, marker="o", label=engine)
            ax.set_xticks(range(len(rates)), rates)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylim(bottom=0)  # from zero: a gap between lines reads as its real size
            ax.set_title(f"{title}\n{model} {workload}", fontsize=9)
            ax.grid(alpha=0.3)
        axes_row[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
