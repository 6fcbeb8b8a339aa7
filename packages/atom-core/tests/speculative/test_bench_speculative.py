"""`atom bench` with speculative decoding: a random EAGLE-3 drafter written for the
shape, forced acceptance, and the mean accepted length in the table and the JSON."""

from __future__ import annotations

import json
import sys

from atom.bench.drafter import BENCH_DRAFT_VOCAB
from atom.cli import main

SPEC = '{"method": "eagle3", "num_speculative_tokens": 2, "forced_acceptance": 0.7}'


def test_bench_reports_the_accepted_length(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in sys.path if p))
    out = tmp_path / "out"
    argv = ["bench", "--engines", "atom", "--shapes", "tiny", "--workloads", "4x8->24"]
    argv += ["--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out)]
    main(argv + ["--atom-option", f"speculative_config={SPEC}"])
    (result,) = json.loads((out / "bench.json").read_text())["results"]
    assert result["output_tokens"] == 96 and result["short_outputs"] == 0
    # Each draft accepted with probability 0.7 until the first rejection: 2.19 expected.
    assert 1.6 < result["mean_accepted_length"] < 2.8, result
    assert "tokens/verify step" in capsys.readouterr().out
    (drafter,) = (tmp_path / "work" / "checkpoints").rglob("*.eagle3-random-*")
    config = json.loads((drafter / "config.json").read_text())
    assert config["draft_vocab_size"] == min(BENCH_DRAFT_VOCAB, config["vocab_size"])
