"""`atom bench serve` against one real `atom serve` on a tiny random checkpoint (CPU),
started the way `atom bench serve-suite` starts it; and the suite's report of a server
that does not start."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from atom.bench.engines import ENGINES
from atom.bench.run import Clock, ensure_checkpoint
from atom.bench.serve.metrics import Slo
from atom.bench.serve.servers import ServerSettings, free_port, running_process, server_command
from atom.bench.serve.sweep import Sweep, run_requests
from atom.bench.serve.tokenizer import ensure_tokenizer
from atom.bench.serve.workloads import parse_serve_workloads
from atom.bench.shapes import SHAPES
from atom.cli import main
from atom.testing import wait_healthy

TINY = SHAPES["tiny"]
WORKLOADS = "random:24:6,shared-prefix:2x40:8:3-9"
KEY = "bench-key"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The suite's work folder, holding the tiny checkpoint and its tokenizer."""
    work = tmp_path_factory.mktemp("work")
    folder = ensure_checkpoint(TINY, work, Clock())
    ensure_tokenizer(folder, TINY.vocab_size)
    return work


@pytest.fixture(scope="module")
def server(work):
    """The base URL of `atom serve` on the tiny checkpoint, started as the suite does, with
    an API key."""
    port = free_port()
    settings = ServerSettings("cpu", 256, 0.9, {"atom": f"--max-num-seqs 8 --api-key {KEY}"})
    folder = TINY.cache_folder(work / "checkpoints")
    command = server_command(ENGINES["atom"], folder, "tiny", port, settings)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    log = work / "logs" / "server.log"
    with running_process(command, env, log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log, timeout=120)
        yield url


def test_sweep_reports_every_request_with_exact_lengths(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    out = tmp_path / "out"
    main(["bench", "serve", "--base-url", server, "--vocab-size", "512", "--label", "atom",
          "--workloads", WORKLOADS, "--rates", "20,inf", "--num-prompts", "6",
          "--max-concurrency", "4", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
          "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "shared-prefix:2x40:8:3-9" in printed
    saved = json.loads((out / "serve-atom.json").read_text())
    assert saved["settings"]["model"] == "tiny" and saved["settings"]["rates"] == ["20", "inf"]
    rows = saved["results"]
    assert [(r["workload"], r["rate"]) for r in rows] == [
        ("random:24:6", "20"), ("random:24:6", "inf"),
        ("shared-prefix:2x40:8:3-9", "20"), ("shared-prefix:2x40:8:3-9", "inf"),
    ]  # fmt: skip
    shared = parse_serve_workloads(WORKLOADS)[1]
    for r in rows:
        assert (r["completed"], r["failed"], r["short_outputs"]) == (6, 0, 0), r["errors"]
        assert r["engine"] == "atom" and r["max_concurrency"] == 4
        # Every output length exact (ignore_eos + min_tokens), as the seed drew it.
        drawn = shared.requests(6, 512, f"0:{r['rate']}") if "shared" in r["workload"] else []
        expected = sum(q.output_len for q in drawn) if drawn else 6 * 6
        assert r["output_tokens"] == expected
        assert r["input_tokens"] == (6 * 24 if not drawn else sum(len(q.prompt) for q in drawn))
        assert r["goodput"] == r["request_throughput"] > 0  # SLOs nobody misses
        for stat in ("p50", "p90", "p99"):  # TTFT <= latency per request, so per rank
            assert 0 < r["ttft_ms"][stat] <= r["e2el_ms"][stat]
        for field in ("tpot_ms", "itl_ms", "output_throughput", "duration_s"):
            assert r[field]
    assert (out / "serve-atom.md").read_text().startswith("| model | workload |")


def test_each_request_streams_one_chunk_per_token(server):
    """Per request: TTFT within the latency, one ITL gap per token after the first (the
    tokenizer the suite writes makes every token a text chunk); chat as well."""
    for endpoint in ("completions", "chat"):
        sweep = Sweep(server, "tiny", endpoint, parse_serve_workloads("random:16:5"), [], 3,
                      None, 512, 0, Slo(), 0, 60.0, api_key=KEY)  # fmt: skip
        requests = sweep.workloads[0].requests(3, 512, "per-request")
        results, duration = asyncio.run(run_requests(sweep, requests, [0.0] * 3, endpoint))
        for r in results:
            assert r.ok, r.error
            assert r.output_tokens == 5 and len(r.itl) == 4
            assert 0 < r.ttft <= r.latency <= duration
        if endpoint == "completions":
            assert [r.prompt_len for r in results] == [16] * 3


def test_suite_reports_a_server_that_does_not_start(work, tmp_path, capsys):
    argv = ["bench", "serve-suite", "--engines", "atom", "--shapes", "tiny", "--device", "cpu",
            "--atom-args=--no-such-option", "--workloads", "random:8:4", "--rates", "inf",
            "--work", str(work), "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit, match="failed: tiny / atom"):
        main(argv)
    printed = capsys.readouterr().out
    assert "tiny / atom: FAILED: server exited" in printed and "--no-such-option" in printed
    assert not (tmp_path / "serve-suite.json").exists()


def test_failed_requests_and_their_reasons_are_reported(server, tmp_path, capsys):
    out = tmp_path / "out"
    main(["bench", "serve", "--base-url", server, "--model", "tiny", "--api-key", "wrong",
          "--vocab-size", "512", "--workloads", "random:8:2", "--rates", "inf",
          "--num-prompts", "2", "--warmup", "0", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "server random:8:2 @ inf: 2 failed: HTTP 401" in printed
    assert "failed requests" in (out / "serve-server.md").read_text()
    assert (out / "serve-server.png").is_file()
    assert json.loads((out / "serve-server.json").read_text())["settings"]["api_key"] == "<set>"
