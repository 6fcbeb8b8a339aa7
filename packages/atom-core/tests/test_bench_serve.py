"""`atom bench serve`'s pure parts against hand-computed values: percentiles, TPOT, goodput,
Poisson arrivals, workloads, the stream parser, the table and the servers' command lines."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
from pathlib import Path

import httpx
import pytest

from atom.bench.engines import ENGINES
from atom.bench.serve.arrivals import parse_rates, poisson_arrivals
from atom.bench.serve.client import RequestResult, chunk_output, request_body, send
from atom.bench.serve.metrics import Slo, meets, percentile, summarize, tpot
from atom.bench.serve.plot import write_plot
from atom.bench.serve.report import format_table, merge_results, write_results
from atom.bench.serve.servers import ServerSettings, server_command
from atom.bench.serve.workloads import (
    SHAREGPT_INPUT,
    Request,
    UniformLengths,
    parse_serve_workloads,
)
from atom.bench.workloads import BenchError
from atom.cli import main


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5  # the mean of the middle two
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert (percentile(values, 0), percentile(values, 100)) == (1.0, 4.0)
    assert percentile([7.0], 99) == 7.0


def result(ttft: float, latency: float, tokens: int, expected: int | None = None, **kw):
    return RequestResult(10, expected or tokens, ok=True, output_tokens=tokens, ttft=ttft,
                         latency=latency, **kw)  # fmt: skip


def test_tpot_leaves_out_the_first_token():
    assert tpot(result(0.1, 1.0, 10)) == pytest.approx(0.1)  # 0.9 s over 9 tokens
    assert tpot(result(0.2, 0.2, 1)) is None


def test_goodput_counts_requests_within_every_slo():
    results = [
        result(0.05, 0.50, 10),  # TTFT 50 ms, TPOT 50 ms
        result(0.05, 0.14, 10),  # TPOT 10 ms
        result(0.30, 0.39, 10),  # TTFT 300 ms
        result(0.08, 0.08, 1),  # one token: no TPOT to miss
        RequestResult(10, 10, error="HTTP 500: boom"),
    ]
    slo = Slo(ttft_ms=100, tpot_ms=20)
    assert [meets(r, slo) for r in results[:4]] == [False, True, False, True]
    summary = summarize(results, duration_s=2.0, slo=slo)
    assert summary["goodput"] == 1.0  # 2 good requests in 2 s
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["errors"] == ["HTTP 500: boom"]
    assert summarize(results, 2.0, Slo())["goodput"] is None  # no SLO, no goodput
    assert summarize(results, 2.0, Slo(ttft_ms=100))["goodput"] == 1.5


def test_summary_throughputs_and_distributions_by_hand():
    results = [
        result(0.1, 0.4, 4, itl=[0.1, 0.1, 0.1]),
        result(0.3, 0.5, 3, expected=4, itl=[0.1, 0.1]),  # one token short
    ]
    summary = summarize(results, duration_s=0.5, slo=Slo())
    assert summary["output_tokens"] == 7 and summary["input_tokens"] == 20
    assert summary["short_outputs"] == 1
    assert summary["request_throughput"] == 4.0
    assert summary["output_throughput"] == 14.0
    assert summary["total_token_throughput"] == 54.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100.0)  # both 100 ms per token
    assert summary["itl_ms"]["p99"] == pytest.approx(100.0)  # 5 gaps pooled
    assert summary["e2el_ms"]["p90"] == pytest.approx(490.0)
    assert summarize([RequestResult(1, 1)], 1.0, Slo())["ttft_ms"] is None


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    times = poisson_arrivals(20000, rate=4.0, seed="a")
    assert times == poisson_arrivals(20000, 4.0, "a") and times != poisson_arrivals(20000, 4.0, "b")
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential gaps: P(gap > mean) = 1/e.
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    assert poisson_arrivals(3, math.inf, "a") == [0.0, 0.0, 0.0]


def test_parse_rates():
    assert parse_rates("1, 4,inf") == [1.0, 4.0, math.inf]
    for bad in ("", "0", "-1", "x", "nan", "2,2"):
        with pytest.raises(BenchError):
            parse_rates(bad)


def test_workload_spellings():
    random_w, sharegpt, shared, long_w, sized = parse_serve_workloads(
        "random:128-256:64,sharegpt,shared-prefix:4x512:32:16,long,random:8:4@5"
    )
    assert (random_w.input, random_w.output) == (UniformLengths(128, 256), UniformLengths(64, 64))
    assert sharegpt.input == SHAREGPT_INPUT and sharegpt.num_prompts is None
    assert (shared.prefix_groups, shared.prefix_len, shared.longest) == (4, 512, 560)
    assert (long_w.input.high, long_w.output.high, long_w.num_prompts) == (32768, 128, 16)
    assert sized.num_prompts == 5
    for bad in ("random:8", "random:0:4", "random:9-8:4", "sharegpt:1", "x", "random:8:4@0",
                "shared-prefix:0x8:4:4", "random:8:4,random:8:4"):  # fmt: skip
        with pytest.raises(BenchError):
            parse_serve_workloads(bad)


def test_requests_have_exact_lengths_and_shared_prefixes():
    (w,) = parse_serve_workloads("shared-prefix:3x20:5-9:4-6")
    requests = w.requests(9, vocab_size=1000, seed="s")
    assert requests == w.requests(9, 1000, "s") and requests != w.requests(9, 1000, "t")
    assert all(25 <= len(r.prompt) <= 29 and 4 <= r.output_len <= 6 for r in requests)
    assert all(100 <= t < 1000 for r in requests for t in r.prompt)
    prefixes = [tuple(r.prompt[:20]) for r in requests]
    assert len(set(prefixes)) == 3 and prefixes[0] == prefixes[3] == prefixes[6]
    assert len({tuple(r.prompt[20:]) for r in requests}) == 9


def test_sharegpt_lengths_are_long_tailed_within_bounds():
    (w,) = parse_serve_workloads("sharegpt")
    requests = w.requests(4000, vocab_size=32000, seed="0")
    inputs = [len(r.prompt) for r in requests]
    outputs = [r.output_len for r in requests]
    assert min(inputs) >= 4 and max(inputs) <= 2048 and max(outputs) <= 1024
    assert statistics.median(inputs) == pytest.approx(128, rel=0.1)
    assert statistics.fmean(inputs) > 1.5 * statistics.median(inputs)  # the long tail


def test_request_body_asks_for_exact_lengths():
    body = request_body(Request([5, 6, 7], 9), "completions", "m")
    assert body["prompt"] == [5, 6, 7] and body["model"] == "m"
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (9, 9, True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = request_body(Request([5, 6], 9), "chat", "m")
    assert "prompt" not in chat and len(chat["messages"][0]["content"].split()) == 2


@pytest.mark.parametrize(
    "chunk, expected",
    [
        ({"choices": [{"text": "a", "finish_reason": None}]}, (True, False)),
        ({"choices": [{"text": "", "finish_reason": "length"}]}, (False, True)),
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, (False, False)),
        ({"choices": [{"delta": {"content": "b"}, "finish_reason": "stop"}]}, (True, True)),
        ({"choices": [{"text": "", "token_ids": [3]}]}, (True, False)),
        ({"choices": [], "usage": {"completion_tokens": 3}}, (False, False)),
    ],
)
def test_chunk_output(chunk, expected):
    assert chunk_output(chunk) == expected


def sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def send_to(body: str, status: int = 200) -> RequestResult:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://x", "completions", "m", Request([1, 2], 3))

    return asyncio.run(go())


def text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"text": t, "finish_reason": finish}]}


def test_send_counts_tokens_from_usage_else_chunks():
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    streamed = send_to(sse(text("a"), text("b"), text("c", "length"), usage))
    assert streamed.ok and streamed.output_tokens == 3 and len(streamed.itl) == 2
    assert 0 < streamed.ttft <= streamed.latency
    no_usage = send_to(sse(text("a"), text("b"), text("", "length")))
    assert no_usage.output_tokens == 2 and len(no_usage.itl) == 1
    # A server without a tokenizer sends no text: the final chunk is the first output.
    silent = send_to(sse(text("", "length"), usage))
    assert silent.ok and silent.output_tokens == 3 and silent.itl == []


def test_send_reports_failures():
    assert send_to('{"error": "bad"}', status=400).error.startswith("HTTP 400: ")
    failed = send_to(sse(text("a"), {"error": {"message": "engine died"}}))
    assert not failed.ok and "engine died" in failed.error
    assert send_to(sse()).error == "the stream carried no output"


def row(engine: str, rate: str, ttft: float) -> dict:
    stats = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
    return dict(engine=engine, model="m", workload="random:8:4", rate=rate, requests=2,
                completed=2, request_throughput=1.0, output_throughput=8.0, goodput=None,
                ttft_ms=stats, tpot_ms=stats, itl_ms=stats, e2el_ms=stats)  # fmt: skip


def test_compare_merges_files_side_by_side(tmp_path, capsys):
    write_results(tmp_path / "a.json", {}, [row("atom", "inf", 5.0), row("atom", "2", 1.0)])
    write_results(tmp_path / "b.json", {}, [row("vllm", "2", 2.0), row("vllm", "inf", 9.0)])
    rows = merge_results([tmp_path / "a.json", tmp_path / "b.json"])
    lines = format_table(rows).splitlines()
    assert [line.split()[2:4] for line in lines[2:]] == [
        ["2", "atom"], ["2", "vllm"], ["inf", "atom"], ["inf", "vllm"]
    ]  # fmt: skip
    assert format_table(rows, markdown=True).splitlines()[1].startswith("|---|")
    with pytest.raises(BenchError, match="distinct --label"):
        merge_results([tmp_path / "a.json", tmp_path / "a.json"])
    main(["bench", "serve", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
          "--out", str(tmp_path / "out")])  # fmt: skip
    assert "vllm" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "out" / "serve-compare.json").read_text())["results"]) == 4


def test_plot_is_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    why = write_plot(tmp_path / "p.png", [row("atom", "1", 1.0)])
    assert why.startswith("plot skipped: matplotlib is not installed")
    assert not (tmp_path / "p.png").exists()


def test_server_commands():
    settings = ServerSettings("cuda", 4096, 0.8, {"vllm": "--enforce-eager", "atom": ""})
    model = Path("/ckpt")
    atom_cmd = server_command(ENGINES["atom"], model, "qwen3-8b", 9000, settings)
    assert atom_cmd[1:5] == ["-m", "atom.cli", "serve", "/ckpt"]
    assert "--gpu-memory-utilization" in atom_cmd and "bfloat16" in atom_cmd
    vllm_cmd = server_command(ENGINES["vllm-atom"], model, "qwen3-8b", 9000, settings)
    assert vllm_cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/ckpt"]
    assert vllm_cmd[-1] == "--enforce-eager"
    for name, backend in (("sglang", "triton"), ("sglang-atom", "atom")):
        cmd = server_command(ENGINES[name], model, "qwen3-8b", 9000, settings)
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        assert cmd[cmd.index("--attention-backend") + 1] == backend
    cpu = server_command(ENGINES["atom"], model, "t", 1, ServerSettings("cpu", 64, 0.8, {}))
    assert "--gpu-memory-utilization" not in cpu and "float32" in cpu


@pytest.mark.parametrize(
    "argv", [["--rates", "0"], ["--workloads", "random:1"], ["--max-concurrency", "0"]]
)
def test_bad_options_end_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--model", "m", *argv])
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def suite_args(*argv: str):
    from atom.cli import build_parser

    return build_parser().parse_args(["bench", "serve-suite", *argv])


def test_suite_context_length_and_engine_checks():
    from atom.bench.serve.suite import resolve

    args = suite_args("--shapes", "qwen3-8b,deepseek-v2-lite", "--workloads", "long,sharegpt")
    resolve(args)
    assert args.max_model_len == 32768 + 128  # the longest request sets it
    assert [s.name for s in args.shape_list] == ["qwen3-8b", "deepseek-v2-lite"]
    tiny = suite_args("--shapes", "tiny", "--device", "cpu", "--engines", "atom",
                      "--workloads", "random:32:8")  # fmt: skip
    resolve(tiny)
    assert tiny.max_model_len == 1024  # 4096, cut to the shape's positions
    for argv, message in (
        (["--shapes", "tiny", "--workloads", "sharegpt"], "exceeds tiny's 1024 positions"),
        (["--device", "cpu", "--engines", "atom,vllm"], "atom engine only"),
        (["--rates", "0"], "every rate must be > 0"),
    ):
        with pytest.raises(BenchError, match=message):
            resolve(suite_args(*argv))
