"""The `atom` command line: demo, generate, serve, bench."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine."""
    parser.add_argument(
        "model",
        help="a local folder with config.json and safetensors weights, or a Hugging Face hub "
        "id (read from its cache; downloaded if missing)",
    )
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-model-len", type=int, help="default: the model's context")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache size in bytes")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache storage: auto (the model dtype), fp8 or fp8_e4m3 (e4m3, per-layer scales)",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        help="Gated DeltaNet recurrent state storage (Qwen3-Next, Qwen3.5): auto (the model "
        "dtype), float32, bfloat16 or float16; the math is fp32",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="GPU memory share to use"
    )
    parser.add_argument("--max-num-seqs", type=int, help="default: 512 on GPU, 256 on CPU")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget per step")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs")
    parser.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="MoE: split the experts whole over the GPUs (attention tensor or data parallel)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="MLA models: one batch and KV cache per GPU, MoE experts split over them (needs"
        " -ep; --max-num-seqs and --max-num-batched-tokens are per GPU)",
    )
    parser.add_argument(
        "--all2all-backend",
        default="allgather_reducescatter",
        help="with -dp, how tokens reach the experts' GPUs (vLLM's option): "
        "allgather_reducescatter, or all_to_all (each token to its experts' GPUs only, after "
        "a host sync per MoE layer: for large batches)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="no KV block reuse")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--compile", action="store_true", help="torch.compile the sampler")
    parser.add_argument(
        "--skip-tokenizer-init", action="store_true", help="token-id prompts only, no text"
    )
    parser.add_argument(
        "--speculative-config",
        type=json_object,
        help='speculative decoding, as vLLM\'s: \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size=args.data_parallel_size,
        all2all_backend=args.all2all_backend,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        compile=args.compile,
        skip_tokenizer_init=args.skip_tokenizer_init,
        speculative_config=args.speculative_config,
    )


def _demo(args: argparse.Namespace) -> None:
    with server_extra_required("demo"):  # its HTTP round trip
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401

        import atom.server  # noqa: F401
    from atom.demo import run_demo

    run_demo(args.out)


def _generate(args: argparse.Namespace) -> None:
    from atom import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    prompts = [[int(t) for t in p.split(",")] if args.token_ids else p for p in args.prompt]
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        print(completion.text if llm.tokenizer is not None else completion.token_ids)


# Top-level modules that only the `server` extra brings (with their own dependencies).
SERVER_EXTRA_MODULES = frozenset(
    {"fastapi", "starlette", "pydantic", "uvicorn", "jinja2", "httpx", "prometheus_client"}
)
SERVER_EXTRA_HINT = 'pip install "atom-core[server]"'


@contextmanager
def server_extra_required(command: str) -> Iterator[None]:
    """Around the imports of the `server` extra's modules, done before any model loads (some
    are imported only later, inside the server): a missing one ends `command` with one line."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in SERVER_EXTRA_MODULES:
            raise
        raise SystemExit(
            f"atom {command}: the HTTP server needs the `server` extra ({exc.name} is "
            f"missing): {SERVER_EXTRA_HINT}"
        ) from None


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """`atom serve`'s own options, grouped for --help (the engine's come first)."""
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on")
    http.add_argument("--port", type=int, default=8000, help="checked before the model loads")
    http.add_argument(
        "--api-key",
        help="/v1 routes then need Authorization: Bearer KEY (default: $ATOM_API_KEY, else "
        "$VLLM_API_KEY)",
    )
    http.add_argument("--allowed-origins", nargs="+", default=["*"], help="CORS origins")
    http.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS methods")
    http.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS headers")
    http.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    http.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        default="info",
        help="uvicorn's: debug, info, warning",
    )
    api = serve.add_argument_group("API")
    api.add_argument("--served-model-name", help="the model name clients use (default: MODEL)")
    api.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    api.add_argument(
        "--generation-config",
        default="auto",
        help="request sampling defaults: auto (the model's generation_config.json), vllm "
        "(none), or a folder holding a generation_config.json",
    )
    api.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="how tool calls are read from the output, by vLLM's names: hermes (Qwen3, "
        "Qwen3-MoE, Qwen3-Next), llama3_json, mistral (Mixtral), deepseek_v3, deepseek_v31 "
        "(DeepSeek-V3.1/V3.2), kimi_k2, glm45 / glm47 (GLM-4.5 to GLM-5), qwen3_coder "
        "(Qwen3.5), minimax_m2, openai (GPT-OSS harmony)",
    )
    api.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted as in vLLM: ATOM reads tool calls with or without it",
    )
    api.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    api.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted as in vLLM; has no effect: ATOM runs no code from the checkpoint",
    )
    limits = serve.add_argument_group("limits (a request over one gets a 4xx)")
    limits.add_argument(
        "--max-n", type=int, default=128, help="most choices per request: n, best_of, prompts x n"
    )
    limits.add_argument(
        "--max-stop-strings", type=int, default=64, help="most stop strings per request"
    )
    limits.add_argument(
        "--max-stop-chars",
        type=int,
        default=16384,
        help="most characters of a request's stop strings, all together",
    )
    limits.add_argument(
        "--max-unread-tokens",
        type=int,
        default=16384,
        help="output tokens a streaming client may leave unread before its request is aborted",
    )
    limits.add_argument(
        "--max-request-body-bytes", type=int, default=16 * 2**20, help="larger bodies get a 413"
    )


def _serve(args: argparse.Namespace) -> None:
    with server_extra_required("serve"):
        import uvicorn  # noqa: F401

        from atom.server import StartupError, run_server

    kwargs = engine_kwargs(args)
    try:
        run_server(
            kwargs.pop("model"),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            served_model_name=args.served_model_name or args.model,
            chat_template=args.chat_template,
            api_key=args.api_key
            or os.environ.get("ATOM_API_KEY")
            or os.environ.get("VLLM_API_KEY"),
            allowed_origins=tuple(args.allowed_origins),
            allowed_methods=tuple(args.allowed_methods),
            allowed_headers=tuple(args.allowed_headers),
            allow_credentials=args.allow_credentials,
            max_n=args.max_n,
            max_request_body_bytes=args.max_request_body_bytes,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
            max_unread_tokens=args.max_unread_tokens,
            generation_config=args.generation_config,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            seed=args.seed,
            trust_remote_code=args.trust_remote_code,
            **kwargs,
        )
    except StartupError as exc:
        raise SystemExit(f"atom serve: error: {exc}") from None


def _bench(args: argparse.Namespace) -> None:
    from atom.bench.run import main as run_bench
    from atom.bench.workloads import BenchError

    try:
        results = run_bench(args)
    except BenchError as exc:
        args.parser.error(str(exc))
    if any("error" in r for r in results):
        raise SystemExit("atom bench: some runs failed; see their logs above")


def _bench_serve(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("httpx") is None:
        raise SystemExit(
            f'atom bench {args.bench_command}: needs httpx: pip install "atom-core[bench]"'
        )
    from atom.bench.serve.run import main as run_serve_bench
    from atom.bench.serve.suite import main as run_serve_suite
    from atom.bench.workloads import BenchError

    try:
        (run_serve_suite if args.bench_command == "serve-suite" else run_serve_bench)(args)
    except BenchError as exc:
        args.parser.error(str(exc))


def _bench_check(args: argparse.Namespace) -> None:
    from atom.bench.check import main as run_check
    from atom.bench.workloads import BenchError

    try:
        rows = run_check(args)
    except BenchError as exc:
        args.parser.error(str(exc))
    if any("error" in r or not r.get("passed", True) for r in rows):
        raise SystemExit("atom bench check: some engines disagree with their reference or failed")


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """`atom bench check` (teacher-forced correctness) and the online serving benchmarks
    `atom bench serve` and `atom bench serve-suite`."""
    from atom.bench.check import add_arguments as add_check_arguments
    from atom.bench.serve.options import add_serve_arguments, add_suite_arguments

    online = bench.add_subparsers(dest="bench_command", title="subcommands (optional)")
    check = online.add_parser(
        "check",
        help="teacher-forced logprobs of each engine against HF transformers (float32) and "
        "its host's own model; fails when they differ by more than the dtype explains",
        description="Feeds the same random token streams to HF transformers (float32, and "
        "in the engines' dtype as the rounding floor) and to each engine, and prints per "
        "shape the top-1 agreement and log-probability differences; exits 1 when an "
        "engine is further from its reference than the floor allows. Writes "
        "OUT/check.json. Example: atom bench check --engines atom,vllm,vllm-atom "
        "--shapes qwen3-8b:8 --streams 4x512",
    )
    add_check_arguments(check)
    check.set_defaults(func=_bench_check, parser=check)
    serve = online.add_parser(
        "serve",
        help="a running OpenAI-compatible server under a Poisson rate sweep: TTFT, TPOT, ITL",
        description="Streams completions to a running server (atom serve, vllm serve, "
        "SGLang) at each request rate, prints TTFT/TPOT/ITL percentiles, throughput and "
        "goodput, writes OUT/serve-LABEL.{json,md,png}; --compare merges such files. "
        "See docs/benchmarks.md. Example: atom bench serve --base-url http://127.0.0.1:8000 "
        "--workloads random:1024:128,sharegpt --rates 1,4,inf --max-concurrency 64",
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=_bench_serve, parser=serve)
    suite = online.add_parser(
        "serve-suite",
        help="start each engine's server in turn on random checkpoints and sweep it",
        description="For each shape and engine: writes the random checkpoint (and a "
        "tokenizer), starts the engine's OpenAI server, runs the `atom bench serve` sweep, "
        "stops it; writes OUT/serve-suite.{json,md,png} side by side. See docs/benchmarks.md.",
    )
    add_suite_arguments(suite)
    suite.set_defaults(func=_bench_serve, parser=suite)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atom", description="ATOM: LLM models, kernels and engine"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="build a tiny random model locally and generate with it"
    )
    demo.add_argument("--out", help="folder for the demo checkpoint (default: a temporary one)")
    demo.set_defaults(func=_demo)

    generate = commands.add_parser("generate", help="generate completions offline")
    add_engine_args(generate)
    generate.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    generate.add_argument(
        "--token-ids", action="store_true", help="prompts are comma-separated token ids"
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int)
    generate.set_defaults(func=_generate)

    serve = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serves MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models) plus /tokenize, /detokenize, /version, /health and /metrics. "
        "See docs/serving.md.",
    )
    add_engine_args(serve.add_argument_group("engine"))
    add_serve_args(serve)
    serve.set_defaults(func=_serve)

    from atom.bench.run import add_arguments as add_bench_arguments

    bench = commands.add_parser(
        "bench",
        help="ATOM's engine next to vLLM / SGLang on one GPU: output tokens/s, table, plot",
        description="Runs each engine in its own process on the same random-weight "
        "checkpoint and random prompts (greedy, ignore_eos), prints output/total tokens/s "
        "and the ratio to a baseline, writes OUT/bench.json and OUT/bench.png. Example: "
        "atom bench --engines atom,vllm,vllm-atom --shapes qwen3-0.6b "
        "--workloads '1x128->256,1024x512->256' --vllm-path /tmp/site",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench, parser=bench)
    add_bench_commands(bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
