"""`atom bench serve`: options, one sweep against a running server, and `--compare`."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from atom.bench.serve.arrivals import parse_rates
from atom.bench.serve.metrics import Slo
from atom.bench.serve.plot import write_plot
from atom.bench.serve.report import format_table, merge_results, write_results
from atom.bench.serve.sweep import Sweep, run_sweep
from atom.bench.serve.workloads import parse_serve_workloads
from atom.bench.workloads import BenchError


def make_sweep(args: argparse.Namespace, base_url: str, model: str, vocab_size: int) -> Sweep:
    """The sweep the options describe; raises BenchError for a bad option."""
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be >= 1")
    return Sweep(
        base_url=base_url.rstrip("/"),
        model=model,
        endpoint=args.endpoint,
        workloads=parse_serve_workloads(args.workloads),
        rates=parse_rates(args.rates),
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        vocab_size=vocab_size,
        seed=args.seed,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms),
        warmup=args.warmup,
        timeout_s=args.request_timeout,
        api_key=getattr(args, "api_key", None),  # serve-suite starts its own servers, keyless
    )


def served_model(base_url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30, headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise BenchError(f"no model list at {base_url}/v1/models ({exc}); pass --model") from None


def publish(rows: list[dict], out: Path, stem: str, settings: dict) -> None:
    """Prints the table; writes OUT/STEM.json, OUT/STEM.md (the table) and OUT/STEM.png."""
    write_results(out / f"{stem}.json", settings, rows)
    (out / f"{stem}.md").write_text(format_table(rows, markdown=True) + "\n")
    print(format_table(rows), flush=True)
    print(write_plot(out / f"{stem}.png", rows) or f"plot: {out / f'{stem}.png'}")
    print(f"results: {out / f'{stem}.json'}", flush=True)


def main(args: argparse.Namespace) -> list[dict]:
    out = Path(args.out)
    if args.compare:
        rows = merge_results([Path(p) for p in args.compare])
        publish(rows, out, "serve-compare", {"compare": args.compare})
        return rows
    model = args.model or served_model(args.base_url, args.api_key)
    sweep = make_sweep(args, args.base_url, model, args.vocab_size)
    rows = [dict(engine=args.label, model=model) | row for row in run_sweep(sweep)]
    publish(rows, out, f"serve-{args.label}", {"engine": args.label} | sweep.settings())
    return rows
