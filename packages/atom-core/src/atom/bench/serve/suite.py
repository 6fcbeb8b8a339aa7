"""`atom bench serve-suite`: every engine's server in turn on random checkpoints, one sweep each.

Per shape: the random checkpoint (atom.bench.run.ensure_checkpoint, cached) and a tokenizer
for it; per engine: its server on a free port, the `atom bench serve` sweep once /health
answers, then the server and all its processes stop. Each engine's rows go to
OUT/serve-suite/SHAPE.ENGINE.json as soon as they exist (an invocation cut short keeps what
it measured; `atom bench serve --compare` merges files of several invocations), all of them
to OUT/serve-suite.{json,md,png}.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from atom.bench.engines import EngineSpec, engine_env, parse_engines
from atom.bench.run import Clock, ensure_checkpoint
from atom.bench.serve.report import write_results
from atom.bench.serve.run import make_sweep, publish
from atom.bench.serve.servers import ServerSettings, free_port, running_process, server_command
from atom.bench.serve.sweep import run_sweep
from atom.bench.serve.tokenizer import ensure_tokenizer
from atom.bench.serve.workloads import parse_serve_workloads
from atom.bench.shapes import Shape, parse_shapes
from atom.bench.workloads import BenchError
from atom.testing.servers import ServerFailed, wait_healthy

DEFAULT_MODEL_LEN = 4096


def resolve(args: argparse.Namespace) -> None:
    """Parses and checks the suite's own options in place; raises BenchError."""
    make_sweep(args, base_url="", model="", vocab_size=1)  # its checks, before any server
    args.engine_list = parse_engines(args.engines)
    args.shape_list = parse_shapes(args.shapes)
    longest = max(w.longest for w in parse_serve_workloads(args.workloads))
    if args.max_model_len is None:
        limit = min(s.fields["max_position_embeddings"] for s in args.shape_list)
        args.max_model_len = max(min(DEFAULT_MODEL_LEN, limit), longest)
    elif args.max_model_len < longest:
        raise BenchError(f"--max-model-len {args.max_model_len} < the longest request ({longest})")
    for shape in args.shape_list:
        if args.max_model_len > shape.fields["max_position_embeddings"]:
            raise BenchError(
                f"--max-model-len {args.max_model_len} exceeds {shape.name}'s "
                f"{shape.fields['max_position_embeddings']} positions"
            )
    if args.device not in ("cuda", "cpu"):
        raise BenchError(f"--device {args.device!r}: use cuda or cpu")
    if args.device == "cpu" and any(e.host != "atom" for e in args.engine_list):
        raise BenchError("--device cpu runs the atom engine only")
    for host, path in (("vllm", args.vllm_path), ("sglang", args.sglang_path)):
        if path and not Path(path).is_dir():
            raise BenchError(f"--{host}-path {path} is not a directory")


def run_engine(
    spec: EngineSpec, shape: Shape, folder: Path, args: argparse.Namespace, clock: Clock
) -> list[dict]:
    """One engine's server on one checkpoint through the whole sweep; [] if it failed."""
    work = Path(args.work)
    tag = f"{shape.name.replace(':', '-L')}.{spec.name}"
    log_path = work / "logs" / f"serve-{tag}.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = ServerSettings(
        args.device,
        args.max_model_len,
        args.gpu_memory_utilization,
        {host: getattr(args, f"{host}_args") for host in ("atom", "vllm", "sglang")},
    )
    command = server_command(spec, folder, shape.name, port, settings)
    env = engine_env(spec, {"vllm": args.vllm_path, "sglang": args.sglang_path}, work)
    where = f"{shape.name} / {spec.name}"
    clock.say(f"{where}: starting its server ({spec.description}); log: {log_path}")
    with running_process(command, env, log_path) as proc:
        try:
            wait_healthy(proc, url, log_path, timeout=args.startup_timeout)
            clock.say(f"{where}: serving on {url}")
            sweep = make_sweep(args, url, shape.name, shape.vocab_size)
            rows = [dict(engine=spec.name, model=shape.name) | r for r in run_sweep(sweep)]
        except (ServerFailed, BenchError) as exc:
            clock.say(f"{where}: FAILED: {exc}")
            return []
    recorded = dict(engine=spec.name, shape=shape.name, server_command=command) | sweep.settings()
    write_results(Path(args.out) / "serve-suite" / f"{tag}.json", recorded, rows)
    clock.say(f"{where}: done")
    return rows


def main(args: argparse.Namespace) -> list[dict]:
    resolve(args)
    work = Path(args.work)
    clock = Clock()
    rows: list[dict] = []
    failed: list[str] = []
    for shape in args.shape_list:
        folder = ensure_checkpoint(shape, work, clock)
        ensure_tokenizer(folder, shape.vocab_size)
        for spec in args.engine_list:
            engine_rows = run_engine(spec, shape, folder, args, clock)
            rows += engine_rows
            failed += [] if engine_rows else [f"{shape.name} / {spec.name}"]
        if args.delete_checkpoints:
            shutil.rmtree(folder)
    if rows:
        per_engine = str(Path(args.out) / "serve-suite")
        publish(rows, Path(args.out), "serve-suite", {"per_engine_settings": per_engine})
    if failed:
        raise SystemExit(f"atom bench serve-suite: failed: {', '.join(failed)}; see the logs")
    return rows
