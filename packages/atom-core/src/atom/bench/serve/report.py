"""Result rows as a side-by-side table (plain or Markdown), JSON files, and their merge.

A row is one engine's run of one workload at one rate (atom.bench.serve.sweep) plus
`engine` and `model`. Rows of several files merge into one table: same model, workload
and rate next to each other, one line per engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from atom.bench.workloads import BenchError

COLUMNS = (
    "model", "workload", "rate", "engine", "done", "req/s", "out tok/s", "goodput",
    "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
)  # fmt: skip


def row_key(row: dict) -> tuple[str, str, str, str]:
    return row["model"], row["workload"], row["rate"], row["engine"]


def ordered(rows: list[dict]) -> list[dict]:
    """Grouped by model, workload and rate (in first-seen order, rates ascending), the
    engines of each group in first-seen order."""
    first: dict[tuple, int] = {}
    for row in rows:
        for key in ((row["model"],), (row["workload"],), (row["engine"],)):
            first.setdefault(key, len(first))
    return sorted(
        rows,
        key=lambda r: (
            first[(r["model"],)],
            first[(r["workload"],)],
            float(r["rate"]),
            first[(r["engine"],)],
        ),
    )


def _ms(row: dict, metric: str, stat: str) -> str:
    values = row.get(metric)
    return "-" if values is None else f"{values[stat]:,.1f}"


def _cells(row: dict) -> list[str]:
    goodput = row.get("goodput")
    return [
        row["model"],
        row["workload"],
        row["rate"],
        row["engine"],
        f"{row['completed']}/{row['requests']}",
        f"{row['request_throughput']:,.2f}",
        f"{row['output_throughput']:,.1f}",
        "-" if goodput is None else f"{goodput:,.2f}",
        _ms(row, "ttft_ms", "p50"),
        _ms(row, "ttft_ms", "p99"),
        _ms(row, "tpot_ms", "p50"),
        _ms(row, "tpot_ms", "p99"),
        _ms(row, "itl_ms", "p50"),
        _ms(row, "itl_ms", "p99"),
    ]


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """Rates in requests/s (inf: all at once), latencies in ms, goodput in requests/s;
    below the table, each run's failed requests and their reasons."""
    cells = [list(COLUMNS)] + [_cells(r) for r in ordered(rows)]
    if markdown:
        lines = ["| " + " | ".join(c) + " |" for c in cells]
        lines.insert(1, "|" + "---|" * len(COLUMNS))
    else:
        widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
    failures = [
        f"{r['engine']} {r['workload']} @ {r['rate']}: {r['failed']} failed: "
        + "; ".join(r.get("errors") or ["(no reason recorded)"])
        for r in ordered(rows)
        if r.get("failed")
    ]
    if failures:
        lines += ["", "failed requests (up to 3 distinct reasons per run):", *failures]
    return "\n".join(lines)


def write_results(path: Path, settings: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "results": rows}, indent=2) + "\n")


def merge_results(paths: list[Path]) -> list[dict]:
    """The rows of several result files; a model/workload/rate/engine in two files is an
    error (name the engines apart with --label)."""
    rows, seen = [], {}
    for path in paths:
        try:
            file_rows = json.loads(Path(path).read_text())["results"]
        except (OSError, ValueError, KeyError) as exc:
            raise BenchError(f"{path}: not a result file of atom bench serve ({exc})") from None
        for row in file_rows:
            key = row_key(row)
            if key in seen:
                raise BenchError(f"{path} and {seen[key]} both hold {key}: use distinct --label")
            seen[key] = path
            rows.append(row)
    return rows
