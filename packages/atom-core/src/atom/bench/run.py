"""`atom bench`: options, the run over shapes x engines, progress, and the outputs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from atom.bench.agreement import agreement, format_agreement
from atom.bench.driver import EVENT
from atom.bench.engines import DEFAULT_ENGINES, ENGINES, EngineSpec, engine_env, parse_engines
from atom.bench.quantize import QUANTIZATIONS, check_quantization
from atom.bench.report import add_ratios, format_table, median_rounds, write_json, write_plot
from atom.bench.shapes import DEFAULT_SHAPES, SHAPES, Shape, parse_shapes
from atom.bench.traffic import add_bandwidth, bytes_moved, element_bytes
from atom.bench.workloads import DEFAULT_WORKLOADS, BenchError, parse_workloads

HEARTBEAT_S = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, DEFAULT_ENGINES, DEFAULT_SHAPES, "bench-results")
    parser.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help=f"NxIN->OUT,... (default: {DEFAULT_WORKLOADS})",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        help="quantize each shape's random checkpoint as this method's quantizer stores it "
        "(gptq, awq: 4-bit group 128; mxfp4: GPT-OSS experts); every engine loads it with "
        "its own kernels",
    )
    parser.add_argument("--baseline", help="engine the ratios divide by (default: vllm if run)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="default: 2048 (less if a shape has fewer positions), or the longest workload",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the engines this many times in turn (order reversed every other round), "
        "each in a fresh process; rows report each engine's median round (the host's speed "
        "differs between processes, which decides host-bound workloads such as 1x128->256)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per workload, each on new prompts; the median run is reported (the "
        "slower middle one for even counts; with --profile, of the runs after the traced "
        "first). Short workloads such as 1x128->256 vary by 10-20%% from run to run",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record a torch-profiler trace of each workload's first timed run and write a "
        "kernel/idle summary next to it in OUT/profiles (slows that run; use short workloads)",
    )


def add_engine_arguments(
    parser: argparse.ArgumentParser, engines: str, shapes: str, out: str
) -> None:
    """The options `atom bench` and `atom bench check` share: what runs, where, and how."""
    parser.add_argument(
        "--engines",
        default=engines,
        help=f"comma-separated, from: {', '.join(ENGINES)} (default: {engines})",
    )
    parser.add_argument(
        "--shapes",
        default=shapes,
        help=f"checkpoint shapes, from: {', '.join(SHAPES)}; NAME:LAYERS sets the depth "
        f"(default: {shapes})",
    )
    parser.add_argument("--vllm-path", help="prepended to PYTHONPATH of vLLM runs")
    parser.add_argument("--sglang-path", help="prepended to PYTHONPATH of SGLang runs")
    parser.add_argument(
        "--device", default="cuda", help="cuda (default) or cpu (ATOM, or a host's CPU build)"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--out", default=out, help=f"folder for the results (default: {out})")
    parser.add_argument(
        "--work",
        default=str(Path.home() / ".cache" / "atom-bench"),
        help="cached checkpoints, job files and engine logs",
    )
    parser.add_argument(
        "--delete-checkpoints",
        action="store_true",
        help="delete each shape's checkpoint after its runs (for small disks)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds per engine and shape (default 3600)"
    )
    for host in ("atom", "vllm", "sglang"):
        parser.add_argument(
            f"--{host}-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"extra keyword for the {host} engine constructor (VALUE parsed as JSON)",
        )


def _options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise BenchError(f"engine option {item!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


class Clock:
    def __init__(self):
        self.start = time.monotonic()

    def say(self, message: str) -> None:
        minutes, seconds = divmod(int(time.monotonic() - self.start), 60)
        print(f"[{minutes:3d}:{seconds:02d}] {message}", flush=True)


def ensure_checkpoint(shape: Shape, work: Path, clock: Clock) -> Path:
    folder = shape.cache_folder(work / "checkpoints")
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    job = folder.with_name(folder.name + ".job.json")
    job.write_text(
        json.dumps(
            dict(
                config_class=shape.config_class,
                architecture=shape.architecture,
                fields=shape.fields,
                quantization=shape.quantization,
                folder=str(folder),
            )
        )
    )
    clock.say(f"{shape.name}: writing a random checkpoint to {folder}")
    proc = subprocess.run(
        [sys.executable, "-m", "atom.bench.checkpoint", str(job)], capture_output=True, text=True
    )
    if proc.returncode:
        raise BenchError(f"writing the {shape.name} checkpoint failed:\n{proc.stderr[-3000:]}")
    return folder


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_engine(
    spec: EngineSpec, shape: Shape, folder: Path, args, clock: Clock, round_index: int = 0
) -> list[dict]:
    """Runs one engine over all workloads in a subprocess; one result dict per workload."""
    tag = f"{shape.name.replace(':', '-L')}.{spec.name}"
    if args.rounds > 1:
        tag += f".round{round_index + 1}"
    job = dict(
        max_model_len=args.max_model_len,
        vocab_size=shape.vocab_size,
        repeats=args.repeats,
        workloads=[asdict(w) for w in args.workload_list],
        profile_dir=str(Path(args.out).resolve() / "profiles") if args.profile else None,
    )
    job_file, env, log_path = write_job(spec, folder, job, tag, args)
    if args.profile:
        (Path(args.out) / "profiles").mkdir(parents=True, exist_ok=True)
        # The profiler in the driver sees vLLM's model only with its engine core in-process.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM names its step's phases (scheduling, input preparation, sampling) in the
        # trace only when asked.
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    where = f"{shape.name} / {spec.name}" + (
        f" (round {round_index + 1}/{args.rounds})" if args.rounds > 1 else ""
    )
    results: dict[str, dict] = {}
    # Engine-independent numerators of GB/s, one per workload (atom.bench.traffic).
    moved = {w.name: bytes_moved(shape, w, element_bytes(args.device)) for w in args.workload_list}

    def on_event(event: dict) -> None:
        if event["event"] == "profile":
            clock.say(f"{where}: {event['workload']}: profile summary {event['report']}")
            print(Path(event["report"]).read_text(), flush=True)
        elif event["event"] == "result":
            add_bandwidth(event, moved[event["workload"]])
            results[event["workload"]] = event
            runs = event["output_tok_s_runs"]
            spread = (
                f"; median of {len(runs)}, {min(runs):,.1f}-{max(runs):,.1f}"
                if len(runs) > 1
                else ""
            )
            gb_s = f", {event['gb_s']:,.2f} GB/s" if "gb_s" in event else ""
            clock.say(
                f"{where}: {event['workload']}: {event['output_tok_s']:,.1f} output tok/s"
                f"{gb_s} ({event['time_s']:.2f} s{spread})"
            )
            if "kv_bytes_per_token" in event:
                clock.say(f"{where}: {event['workload']}: {kv_saving_line(event)}")

    clock.say(f"{where}: starting ({spec.description}); log: {log_path}")
    returncode = drive(job_file, env, log_path, where, clock, args.timeout, on_event)
    if returncode and len(results) < len(args.workload_list):
        tail = log_path.read_text()[-2000:]
        clock.say(f"{where}: FAILED (exit {returncode}); end of its log:\n{tail}")
    rows = []
    for w in args.workload_list:
        row = dict(
            shape=shape.name,
            engine=spec.name,
            workload=w.name,
            num_prompts=w.num_prompts,
            input_len=w.input_len,
            output_len=w.output_len,
        )
        if w.name in results:
            row.update({k: v for k, v in results[w.name].items() if k not in ("event", "workload")})
        else:
            row["error"] = f"no result; see {log_path}"
        rows.append(row)
    return rows


def write_job(spec: EngineSpec, folder: Path, job: dict, tag: str, args) -> tuple[Path, dict, Path]:
    """The driver's job file for `spec` on the checkpoint `folder` (the shared settings of
    `add_engine_arguments` added to `job`), its environment and its log's path."""
    work = Path(args.work)
    job_file = work / "jobs" / f"{tag}.json"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job = dict(
        host=spec.host,
        plugin=spec.plugin is not None,
        model=str(folder),
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        options=args.host_options.get(spec.host, {}),
        tag=tag,
        **job,
    )
    job_file.write_text(json.dumps(job))
    log_path = work / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = engine_env(spec, {"vllm": args.vllm_path, "sglang": args.sglang_path}, work)
    return job_file, env, log_path


def drive(
    job_file: Path, env: dict, log_path: Path, where: str, clock: Clock, timeout: float, on_event
) -> int:
    """Runs `atom.bench.driver` on `job_file` in its own process group, shows its progress
    (ready, the step it is on, a heartbeat), hands every other event to `on_event`, and
    returns its exit status (-9 when it ran past `timeout` seconds)."""
    started = time.monotonic()
    current, current_since = "loading", started
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "atom.bench.driver", str(job_file)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: a timeout ends all its children
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        last_beat = time.monotonic()
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            now = time.monotonic()
            if line.startswith(EVENT):
                event = json.loads(line[len(EVENT) :])
                if event["event"] == "ready":
                    clock.say(f"{where}: ready after {event['init_s']:.1f} s")
                elif event["event"] == "start":
                    current, current_since = event["workload"], now
                    clock.say(f"{where}: running {current}")
                else:
                    on_event(event)
            elif line:
                log.write(line)
            if now - last_beat >= HEARTBEAT_S:
                clock.say(f"{where}: still {current} ({now - current_since:.0f} s)")
                last_beat = now
            if now - started > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                clock.say(f"{where}: timed out after {timeout:.0f} s")
                break
        returncode = proc.wait()
    # Workers an engine leaves behind (compile pools, engine cores) would share the
    # machine with the next engine and skew its figures.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return returncode


def kv_saving_line(event: dict) -> str:
    """ATOM's KV memory per token against the full layout, for the workload's lengths."""
    return (
        f"KV cache {event['kv_bytes_per_token']:,.0f} bytes/token at "
        f"{event['context_len']} tokens ({event['kv_groups']}); the full layout (every layer "
        f"every page): {event['kv_bytes_per_token_full_layout']:,.0f} bytes/token, "
        f"{event['kv_saving']:.2f}x as much"
    )


def resolve(args: argparse.Namespace) -> None:
    """Parses and checks the options in place; raises BenchError with the reason."""
    args.engine_list = parse_engines(args.engines)
    args.shape_list = parse_shapes(args.shapes, args.quantize)
    check_quantization(args.quantize, [s.architecture for s in args.shape_list])
    args.workload_list = parse_workloads(args.workloads)
    names = [e.name for e in args.engine_list]
    if args.baseline is None:
        args.baseline = "vllm" if "vllm" in names else names[0]
    elif args.baseline not in names:
        raise BenchError(f"--baseline {args.baseline} is not among --engines {args.engines}")
    longest = max(w.total_len for w in args.workload_list)
    if args.max_model_len is None:
        limit = min(s.fields["max_position_embeddings"] for s in args.shape_list)
        args.max_model_len = max(min(2048, limit), longest)
    elif args.max_model_len < longest:
        raise BenchError(f"--max-model-len {args.max_model_len} < the longest workload ({longest})")
    for shape in args.shape_list:
        limit = shape.fields["max_position_embeddings"]
        if args.max_model_len > limit:
            raise BenchError(f"--max-model-len exceeds {shape.name}'s {limit} positions")
    if args.rounds < 1:
        raise BenchError(f"--rounds {args.rounds}: run the engines at least once")
    if args.repeats < 1:
        raise BenchError(f"--repeats {args.repeats}: run each workload at least once")
    resolve_hosts(args)


def resolve_hosts(args: argparse.Namespace) -> None:
    """Checks the shared options of `add_engine_arguments` and parses the engine options."""
    if args.device not in ("cuda", "cpu"):
        raise BenchError(f"--device {args.device!r}: use cuda or cpu")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise BenchError("--gpu-memory-utilization must be in (0, 1]")
    hosts = {e.host for e in args.engine_list}
    for host, path in (("vllm", args.vllm_path), ("sglang", args.sglang_path)):
        # one command line serves every engine: only the engines' own hosts must be there
        if host in hosts and path and not Path(path).is_dir():
            raise BenchError(f"--{host}-path {path} is not a directory")
    args.host_options = {
        host: _options(getattr(args, f"{host}_option")) for host in ("atom", "vllm", "sglang")
    }


def main(args: argparse.Namespace) -> list[dict]:
    resolve(args)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    results: list[dict] = []
    for shape in args.shape_list:
        folder = ensure_checkpoint(shape, work, clock)
        rounds = []
        for i in range(args.rounds):
            engines = args.engine_list if i % 2 == 0 else args.engine_list[::-1]
            rounds.append(
                [row for spec in engines for row in run_engine(spec, shape, folder, args, clock, i)]
            )
        results += median_rounds(rounds, args.baseline) if args.rounds > 1 else rounds[0]
        if args.delete_checkpoints:
            shutil.rmtree(folder)
    add_ratios(results, args.baseline)
    settings = {
        k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))
    }
    same_tokens = agreement(results, args.baseline)
    write_json(out / "bench.json", settings, results, same_tokens)
    print(format_table(results, args.baseline), flush=True)
    if same_tokens:
        print(format_agreement(same_tokens), flush=True)
    why_not = write_plot(out / "bench.png", results, args.baseline)
    print(why_not or f"plot: {out / 'bench.png'}")
    print(f"results: {out / 'bench.json'}", flush=True)
    return results
