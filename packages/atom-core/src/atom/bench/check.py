"""`atom bench check`: is each engine's model the same model as HF transformers' and as its
host's own, measured on the GPU with teacher forcing (atom.bench.teacher_forcing).

Per shape, in separate processes on the same random checkpoint: HF transformers in float32
(the reference), HF in the engines' dtype (the rounding floor), then each engine; every
one reads the same random token streams and reports each position's logprobs. Each
engine is compared with the float32 reference, and an ATOM engine also with its host's own
model (`vllm-atom` with `vllm`, native `atom` with vLLM or SGLang). A pair passes when its
error is within what the floor says the dtype explains; the command exits non-zero when a
pair fails or an engine produced nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from atom.bench.agreement import reference_of
from atom.bench.engines import EngineSpec, parse_engines
from atom.bench.run import (
    Clock,
    add_engine_arguments,
    drive,
    ensure_checkpoint,
    resolve_hosts,
    write_job,
)
from atom.bench.shapes import Shape, parse_shapes
from atom.bench.teacher_forcing import compare, decisive_margin, from_json, verdict
from atom.bench.workloads import BenchError, make_prompts, parse_workloads

DEFAULT_ENGINES = "atom,vllm,vllm-atom"
HF = EngineSpec("hf", "hf", None, "HF transformers")
COLUMNS = ["shape", "engine", "reference", "positions", "top-1", "decisive top-1",
           "mean |dlogp|", "max |dlogp| (stream, pos)", "verdict"]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, DEFAULT_ENGINES, "qwen3-0.6b:4", "check-results")
    parser.add_argument(
        "--streams",
        default="4x512",
        help="NxLEN: N random token streams of LEN tokens each engine reads (default: 4x512)",
    )
    parser.add_argument(
        "--top-k", type=int, default=5, help="best tokens each engine reports per position"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="the engines' dtype (default: bfloat16 on cuda, float32 on cpu); the reference "
        "is always HF transformers in float32",
    )


def resolve(args: argparse.Namespace) -> None:
    args.engine_list = parse_engines(args.engines)
    args.shape_list = parse_shapes(args.shapes)
    (args.stream_shape,) = parse_workloads(f"{args.streams}->1")
    if args.stream_shape.input_len < 2:
        raise BenchError(f"--streams {args.streams}: a stream needs at least 2 tokens")
    if args.top_k < 2:
        raise BenchError(f"--top-k {args.top_k}: the decisive margin needs the best 2 tokens")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    positions = min(s.fields["max_position_embeddings"] for s in args.shape_list)
    if args.stream_shape.input_len + 1 > positions:
        raise BenchError(f"--streams {args.streams}: a shape has only {positions} positions")
    # SGLang keeps a few positions of its context length for the output.
    args.max_model_len = min(args.stream_shape.input_len + 64, positions)
    resolve_hosts(args)


def engine_logprobs(
    spec: EngineSpec,
    shape: Shape,
    folder: Path,
    streams: list[list[int]],
    dtype: str,
    name: str,
    args,
    clock: Clock,
):
    """Runs `spec` on `streams` in its own process; its positions, or None."""
    job = dict(dtype=dtype, max_model_len=args.max_model_len, streams=streams, top_k=args.top_k)
    tag = f"check.{shape.name.replace(':', '-L')}.{name}"
    job_file, env, log_path = write_job(spec, folder, job, tag, args)
    got = []
    where = f"{shape.name} / {name}"
    clock.say(f"{where}: starting ({spec.description}, {dtype}); log: {log_path}")
    returncode = drive(
        job_file, env, log_path, where, clock, args.timeout,
        lambda event: got.append(from_json(event["streams"])),
    )  # fmt: skip
    if not got:
        tail = log_path.read_text()[-2000:]
        clock.say(f"{where}: FAILED (exit {returncode}); end of its log:\n{tail}")
        return None
    return got[0]


def check_shape(shape: Shape, folder: Path, args, clock: Clock) -> list[dict]:
    """Every engine's rows for one shape: against float32 HF, and against its host's model."""
    streams = make_prompts(args.stream_shape, shape.vocab_size, args.seed)
    reference = engine_logprobs(HF, shape, folder, streams, "float32", "hf-float32", args, clock)
    if reference is None:
        return [dict(shape=shape.name, engine="hf", error="the float32 reference failed")]
    floor = None
    rows = []
    if args.dtype != "float32":
        name = f"hf-{args.dtype}"
        floor_run = engine_logprobs(HF, shape, folder, streams, args.dtype, name, args, clock)
        if floor_run is None:
            return [dict(shape=shape.name, engine=name, error="the floor run failed")]
        floor = compare(floor_run, reference)
        rows.append(dict(shape=shape.name, engine=name, reference="hf-float32", **floor))
    margin = decisive_margin(floor)
    runs = {
        spec.name: engine_logprobs(spec, shape, folder, streams, args.dtype, spec.name, args, clock)
        for spec in args.engine_list
    }
    host = next((n for n in ("vllm", "sglang") if runs.get(n) is not None), None)
    for name, got in runs.items():
        if got is None:
            rows.append(dict(shape=shape.name, engine=name, error="no logprobs; see its log"))
            continue
        pairs = [("hf-float32", reference, 1)]
        peer = reference_of(name, host or name)
        if peer and runs.get(peer) is not None:
            pairs.append((peer, runs[peer], 2))  # both sides round
        for ref_name, want, noise_sources in pairs:
            metrics = compare(got, want, margin)
            ok, bound = verdict(metrics, floor, noise_sources)
            rows.append(
                dict(shape=shape.name, engine=name, reference=ref_name, passed=ok,
                     bound=bound, **metrics)
            )  # fmt: skip
    return rows


def format_rows(rows: list[dict]) -> str:
    table = [COLUMNS]
    for r in rows:
        if "error" in r:
            table.append([r["shape"], r["engine"], "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        s, i = r["worst_position"]
        table.append([
            r["shape"], r["engine"], r["reference"], str(r["positions"]),
            f"{r['top1_agreement']:.3f}",
            f"{r['decisive_agreement']:.3f} of {r['decisive_positions']}",
            f"{r['mean_abs_diff']:.4f}", f"{r['max_abs_diff']:.3f} ({s}, {i})",
            ("pass" if r["passed"] else "FAIL") if "passed" in r else "floor",
        ])  # fmt: skip
    widths = [max(len(row[c]) for row in table) for c in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
    bounds = sorted({f"  {r['engine']} vs {r['reference']}: {r['bound']}" for r in rows
                     if "bound" in r})  # fmt: skip
    return "\n".join(lines + ["bounds:"] + bounds)


def main(args: argparse.Namespace) -> list[dict]:
    resolve(args)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    rows: list[dict] = []
    settings = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool)}
    for shape in args.shape_list:
        folder = ensure_checkpoint(shape, work, clock)
        shape_rows = check_shape(shape, folder, args, clock)
        print(format_rows(shape_rows), flush=True)
        rows += shape_rows
        # Written after every shape: a long run that is cut off keeps what it measured.
        (out / "check.json").write_text(json.dumps(dict(settings=settings, rows=rows), indent=1))
        if args.delete_checkpoints:
            shutil.rmtree(folder)
    print(f"all shapes:\n{format_rows(rows)}\nresults: {out / 'check.json'}", flush=True)
    return rows
