"""The options of `atom bench serve` and `atom bench serve-suite` (no httpx here: the CLI
builds its parser from this module before it knows which command runs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from atom.bench.engines import ENGINES
from atom.bench.shapes import SHAPES

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

DEFAULT_WORKLOADS = "random:1024:128"
DEFAULT_RATES = "1,4,16,inf"


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """What to send and how fast: shared by `serve` and `serve-suite`."""
    parser.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help="comma-separated: random:IN:OUT (IN, OUT: N or LO-HI, uniform), sharegpt, "
        "shared-prefix:GxP:IN:OUT (G prefixes of P tokens), long[:IN:OUT] (default "
        f"32768 -> 128, 16 requests); @N sets a workload's request count (default: "
        f"{DEFAULT_WORKLOADS})",
    )
    parser.add_argument(
        "--rates", default=DEFAULT_RATES, help=f"requests/s, inf = all at once ({DEFAULT_RATES})"
    )
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    parser.add_argument(
        "--max-concurrency", type=int, help="most requests in flight (default: no cap)"
    )
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    parser.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    parser.add_argument(
        "--request-timeout", type=float, default=600, help="seconds a request may stall"
    )
    parser.add_argument("--out", default="bench-results", help="folder for JSON, table, PNG")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--model", help="the model name to send (default: the server's first)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--label", default="server", help="this engine's name in the results")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="prompt token ids are drawn below this (default 32000: valid for most models)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="JSON",
        help="merge result files of earlier runs into one table and plot; sends nothing",
    )
    add_sweep_arguments(parser)


SUITE_ENGINES = "atom,vllm,vllm-atom,sglang,sglang-atom"
SUITE_SHAPES = "qwen3-8b,qwen3-30b-a3b,deepseek-v2-lite"


def add_suite_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines",
        default=SUITE_ENGINES,
        help=f"comma-separated, from: {', '.join(ENGINES)} (default: {SUITE_ENGINES})",
    )
    parser.add_argument(
        "--shapes",
        default=SUITE_SHAPES,
        help=f"random checkpoints of: {', '.join(SHAPES)}; NAME:LAYERS sets the depth "
        f"(default: {SUITE_SHAPES})",
    )
    parser.add_argument("--vllm-path", help="prepended to PYTHONPATH of vLLM servers")
    parser.add_argument("--sglang-path", help="prepended to PYTHONPATH of SGLang servers")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (ATOM only)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="default: 4096 (less if a shape has fewer positions), or the longest request",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument(
        "--startup-timeout", type=float, default=1200, help="seconds a server may take to start"
    )
    for host in ("atom", "vllm", "sglang"):
        parser.add_argument(
            f"--{host}-args",
            default="",
            help=f"extra options of {host}'s server, one string after '=' (e.g. "
            f"--{host}-args='--enforce-eager')",
        )
    parser.add_argument(
        "--work",
        default=str(Path.home() / ".cache" / "atom-bench"),
        help="cached checkpoints and server logs",
    )
    parser.add_argument(
        "--delete-checkpoints", action="store_true", help="delete each shape's checkpoint after"
    )
    add_sweep_arguments(parser)
