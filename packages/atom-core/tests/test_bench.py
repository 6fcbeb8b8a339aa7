"""`atom bench`: option parsing, prompts, the engines' environments, the report, and one
tiny end-to-end run of ATOM's engine on the CPU."""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import math
import re
import sys

import pytest

from atom.bench.agreement import agreement, format_agreement
from atom.bench.engines import ENGINES, engine_env, parse_engines
from atom.bench.profile import summarize
from atom.bench.report import (
    T95,
    add_ratios,
    format_table,
    median_rounds,
    median_run,
    paired_ratio,
    write_json,
)
from atom.bench.run import add_arguments, resolve
from atom.bench.shapes import SHAPES, Shape, parse_shapes
from atom.bench.traffic import (
    add_bandwidth,
    bytes_moved,
    element_bytes,
    expected_experts,
    kv_row_bytes,
    pass_weight_elements,
)
from atom.bench.workloads import BenchError, Workload, make_prompts, parse_workloads
from atom.cli import main


def test_parse_workloads_accepts_both_spellings():
    assert parse_workloads("1x128->256, 256 x 512 -> 256,4x8x2") == [
        Workload(1, 128, 256),
        Workload(256, 512, 256),
        Workload(4, 8, 2),
    ]
    assert Workload(1, 128, 256).name == "1x128->256"


@pytest.mark.parametrize("text", ["", "1x128", "0x8->8", "ax1->2", "1x2->3,1x2->3", "1x2->-3"])
def test_parse_workloads_rejects(text):
    with pytest.raises(BenchError):
        parse_workloads(text)


def test_prompts_are_deterministic_and_in_range():
    w = Workload(3, 40, 8)
    a, b = make_prompts(w, 1000, seed=0), make_prompts(w, 1000, seed=0)
    assert a == b and len(a) == 3 and all(len(p) == 40 for p in a)
    assert all(100 <= t < 1000 for p in a for t in p)
    assert make_prompts(w, 1000, seed=1) != a
    assert make_prompts(Workload(3, 40, 9), 1000, seed=0) != a  # each workload its own


def test_shapes_and_engines():
    shape = parse_shapes("qwen3-30b-a3b:12")[0]
    assert shape.num_layers == 12 and shape.architecture == "Qwen3MoeForCausalLM"
    assert parse_shapes("qwen3-0.6b")[0].num_layers == 28
    for bad in ("qwen3-9b", "qwen3-8b:0", "tiny,tiny"):
        with pytest.raises(BenchError):
            parse_shapes(bad)
    assert [e.name for e in parse_engines("atom,vllm-atom")] == ["atom", "vllm-atom"]
    with pytest.raises(BenchError, match="known: atom"):
        parse_engines("atom,trt")


def test_engine_env_switches_plugins(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/src")
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    paths = {"vllm": "/tmp/site", "sglang": "/tmp/sgsite"}
    own = engine_env(ENGINES["vllm"], paths, tmp_path)
    assert own["PYTHONPATH"].split(":") == ["/tmp/site", "/src"]
    assert own["ATOM_DISABLE_VLLM_PLUGIN"] == "1"
    assert own["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    plugged = engine_env(ENGINES["vllm-atom"], paths, tmp_path)
    assert "ATOM_DISABLE_VLLM_PLUGIN" not in plugged
    site, shim, rest = plugged["PYTHONPATH"].split(":")
    assert (site, rest) == ("/tmp/site", "/src")
    # The shim makes the plugin's entry point visible to importlib.metadata.
    monkeypatch.syspath_prepend(shim)
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [(p.name, p.value) for p in points if p.name == "atom"] == [
        ("atom", "atom_vllm:register")
    ]
    sglang = engine_env(ENGINES["sglang-atom"], paths, tmp_path)
    assert sglang["PYTHONPATH"].startswith("/tmp/sgsite:")
    assert engine_env(ENGINES["atom"], paths, tmp_path)["PYTHONPATH"] == "/src"


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_resolve_rejects_bad_options(tmp_path):
    cases = {
        "--baseline": ["--engines", "atom", "--baseline", "vllm"],
        "--max-model-len": ["--max-model-len", "100", "--workloads", "1x100->10"],
        "is not a directory": ["--vllm-path", str(tmp_path / "missing")],
        "KEY=VALUE": ["--atom-option", "enforce_eager"],
        "--device": ["--device", "tpu"],
        "--repeats": ["--repeats", "0"],
        "--rounds": ["--rounds", "0"],
    }
    for message, argv in cases.items():
        with pytest.raises(BenchError, match=message):
            resolve(_args(argv))
    args = _args(["--engines", "atom,vllm", "--atom-option", "max_num_seqs=64"])
    resolve(args)
    assert args.baseline == "vllm" and args.max_model_len == 2048
    assert args.host_options["atom"] == {"max_num_seqs": 64}
    # a host path no engine of the run uses is not checked
    resolve(_args(["--engines", "atom,vllm", "--sglang-path", str(tmp_path / "missing")]))


def _result(engine, workload, rate):
    w = parse_workloads(workload)[0]
    return dict(
        shape="s",
        engine=engine,
        workload=w.name,
        num_prompts=w.num_prompts,
        input_len=w.input_len,
        output_len=w.output_len,
        output_tok_s=rate,
        total_tok_s=rate * 3,
        gb_s=rate / 10,
    )


def test_report_ratios_table_and_json(tmp_path):
    results = [
        _result("vllm", "1x8->4", 100.0),
        _result("atom", "1x8->4", 125.0),
        _result("atom", "2x8->4", 50.0),  # no baseline figure for this workload
        dict(_result("vllm", "2x8->4", 0.0), error="no result"),
    ]
    del results[3]["output_tok_s"], results[3]["total_tok_s"], results[3]["gb_s"]
    del results[2]["gb_s"]  # a shape without a traffic model
    add_ratios(results, "vllm")
    assert [r["ratio"] for r in results] == [1.0, 1.25, None, None]
    table = format_table(results, "vllm").splitlines()
    assert "ratio vs vllm" in table[0] and len(table) == 6
    header = re.split(r"\s{2,}", table[0].strip())  # cells are two spaces apart
    assert header[-4:] == ["out tok/s", "GB/s", "total tok/s", "ratio vs vllm"]
    assert table[3].split()[-4:] == ["125.0", "12.50", "375.0", "1.250"]
    assert table[4].split()[-4:] == ["50.0", "-", "150.0", "-"]
    assert "failed" in table[5]
    write_json(tmp_path / "b.json", {"seed": 0}, results, [])
    assert json.loads((tmp_path / "b.json").read_text())["results"][1]["ratio"] == 1.25


def test_greedy_agreement_pairs_each_atom_engine_with_its_host():
    def sample(engine: str, tokens: list[list[int]]) -> dict:
        return dict(shape="s", workload="2x8->4", engine=engine, greedy_sample=tokens)

    same = [[1, 2, 3, 4], [5, 6, 7, 8]]
    results = [
        sample("vllm", same),
        sample("vllm-atom", [[1, 2, 3, 4], [5, 6, 0, 8]]),  # parts after two tokens
        sample("sglang", same),
        sample("sglang-atom", same),
        sample("atom", [[9, 2, 3, 4], [5, 6, 7, 8]]),  # compared with the baseline
    ]
    rows = {(r["engine"], r["reference"]): r for r in agreement(results, "vllm")}
    assert set(rows) == {("vllm-atom", "vllm"), ("sglang-atom", "sglang"), ("atom", "vllm")}
    assert (
        rows["vllm-atom", "vllm"]["identical"],
        rows["vllm-atom", "vllm"]["mean_common_prefix"],
    ) == (1, 3.0)
    assert rows["sglang-atom", "sglang"]["identical"] == 2
    assert rows["atom", "vllm"]["mean_common_prefix"] == 2.0
    text = format_agreement(list(rows.values()))
    assert "vllm-atom vs vllm: 1/2 prompts identical, mean common prefix 3.0 of 4 tokens" in text


def test_rounds_report_each_engines_median_round_and_keep_failures():
    rounds = [
        [_result("vllm", "1x8->4", 100.0), _result("atom", "1x8->4", 120.0)],
        [_result("atom", "1x8->4", 90.0), _result("vllm", "1x8->4", 100.0)],  # reversed
        [_result("vllm", "1x8->4", 80.0), _result("atom", "1x8->4", 100.0)],
    ]
    failed = _result("atom", "2x8->4", 0.0)
    del failed["output_tok_s"]
    rounds[1].append(failed)
    rounds[0].append(_result("atom", "2x8->4", 10.0))
    merged = median_rounds(rounds, "vllm")
    assert [(r["engine"], r["workload"]) for r in merged] == [
        ("vllm", "1x8->4"),
        ("atom", "1x8->4"),
        ("atom", "2x8->4"),
    ]
    vllm, atom, atom_failed = merged
    assert vllm["output_tok_s"] == 100.0 and vllm["output_tok_s_rounds"] == [100.0, 100.0, 80.0]
    assert atom["output_tok_s"] == 100.0 and atom["ratio_rounds"] == [1.2, 0.9, 1.25]
    assert "output_tok_s" not in atom_failed
    add_ratios(merged, "vllm")
    assert atom["ratio"] == 1.0
    assert atom["paired_ratio"] == paired_ratio([1.2, 0.9, 1.25]) and "paired_ratio" not in vllm
    row = format_table(merged, "vllm").splitlines()[3]
    assert row.endswith("1.105 (0.708-1.724)  1.200 0.900 1.250")
    even = [{"output_tok_s": x} for x in (3.0, 1.0, 4.0, 2.0)]
    assert median_run(even)["output_tok_s"] == 2.0  # the slower middle run: a real run


def test_bytes_moved_of_tiny_qwen3_by_hand():
    """The `tiny` shape (hidden 64, 4 heads / 2 KV heads of 16, MLP 128, 2 layers, vocab 512,
    tied), 2x8->4 in float32 as on the CPU."""
    layer = 64 * 64 * 2 + 64 * 32 * 2 + 16 * 2 + 64 * 2 + 3 * 64 * 128  # q,o; k,v; qk/2 norms; MLP
    assert layer == 37_024
    elements = 2 * layer + 64 + 512 * 64  # final norm, the LM head (= the tied embedding)
    assert pass_weight_elements(SHAPES["tiny"].fields, batch=2) == elements == 106_880
    weights = 4 * elements * 4  # 4 passes, 4 bytes
    kv = 2 * (8 + 9 + 10 + 11) * 2 * (2 * 2 * 16 * 4)  # seqs, positions, layers, K+V row
    assert weights + kv == 1_748_992
    assert bytes_moved(SHAPES["tiny"], Workload(2, 8, 4), element_bytes("cpu")) == 1_748_992


def test_bytes_moved_of_qwen3_30b_a3b_by_hand():
    """All 48 layers sparse (128 experts of 3 x 2048 x 768, top 8); 32 query heads and 4 KV
    heads of 128; 2x100->3 in bfloat16."""
    shape = SHAPES["qwen3-30b-a3b"]
    # Two tokens' 8 experts each overlap by 8 * 8/128 = 0.5 on average: 15.5 distinct.
    assert expected_experts(128, 8, 2) == pytest.approx(15.5)
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(128, 8, 10_000) == pytest.approx(128)
    attention = 2048 * 4096 * 2 + 2048 * 512 * 2 + 128 * 2
    router, expert = 2048 * 128, 2048 * 768 * 3
    layer = attention + 2048 * 2 + router + 15.5 * expert
    elements = 48 * layer + 2048 + 151_936 * 2048
    assert elements == 4_740_560_896
    kv = 2 * (100 + 101 + 102) * 48 * (2 * 4 * 128 * 2)
    assert bytes_moved(shape, Workload(2, 100, 3), 2) == 3 * elements * 2 + kv == 28_502_937_600
    # Near the model card's 3.3B activated / 30.5B total, with the input embedding added.
    embedding = 151_936 * 2048
    assert 3.3e9 < pass_weight_elements(shape.fields, batch=1) + embedding < 3.4e9
    assert 30.5e9 < pass_weight_elements(shape.fields, batch=10**9) + embedding < 30.6e9


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_weight_count_matches_the_hf_models_parameters(architecture):
    """At a batch that touches every expert, one pass reads every parameter but the
    (untied) input embedding."""
    from atom.testing import tiny_config, tiny_fields

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(architecture))
    embedding = model.get_input_embeddings().weight.numel()
    parameters = sum(p.numel() for p in model.parameters())
    assert pass_weight_elements(tiny_fields(architecture), 10**9) == parameters - embedding


def test_kv_rows_and_shapes_without_a_weight_model():
    from atom.testing import tiny_fields

    assert kv_row_bytes(tiny_fields("Qwen3ForCausalLM"), 2) == 2 * 2 * 32 * 2
    assert kv_row_bytes(tiny_fields("DeepseekV2ForCausalLM"), 2) == (64 + 16) * 2  # MLA latent
    gpt2 = Shape("gpt2", "GPT2Config", "GPT2LMHeadModel", tiny_fields("GPT2LMHeadModel"))
    assert bytes_moved(gpt2, Workload(1, 8, 4), 2) is None
    row = {"time_s": 2.0}
    add_bandwidth(row, None)
    assert row == {"time_s": 2.0}
    add_bandwidth(row, 3_000_000_000)
    assert row == {"time_s": 2.0, "bytes_moved": 3_000_000_000, "gb_s": 1.5}


def _student_t_cdf(x: float, df: int, steps: int = 20_000) -> float:
    """P(T <= x) for x >= 0, by Simpson's rule over Student's t density."""
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    h = x / steps
    weights = [1 if i in (0, steps) else 4 if i % 2 else 2 for i in range(steps + 1)]
    area = sum(w * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i, w in enumerate(weights))
    return 0.5 + norm * area * h / 3


def test_paired_ratio_is_the_geometric_mean_with_a_student_t_interval():
    assert all(abs(_student_t_cdf(t, df) - 0.975) < 2e-4 for df, t in enumerate(T95, start=1))
    logs = [math.log(x) for x in (1.2, 0.9, 1.25)]
    mean = sum(logs) / 3
    half = 4.303 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    expected = (1.35 ** (1 / 3), math.exp(mean - half), math.exp(mean + half))
    assert paired_ratio([1.2, 0.9, 1.25]) == pytest.approx(expected)
    assert paired_ratio([1.1, 1.1]) == pytest.approx((1.1, 1.1, 1.1))
    assert paired_ratio([1.1]) is None  # one round gives no interval


@pytest.mark.parametrize("profile", [False, True])
def test_atom_bench_end_to_end_on_cpu(tmp_path, capsys, monkeypatch, profile):
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in sys.path if p))
    out = tmp_path / "out"
    argv = ["bench", "--engines", "atom", "--shapes", "tiny", "--workloads", "2x8->4"]
    argv += ["--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out)]
    # Two rounds without the profile: each engine runs twice, in a fresh process each.
    main(argv + ["--repeats", "3"] + (["--profile"] if profile else ["--rounds", "2"]))
    printed = capsys.readouterr().out
    where = "tiny / atom" if profile else "tiny / atom (round 2/2)"
    assert f"{where}: 2x8->4:" in printed and "ratio vs atom" in printed
    (result,) = json.loads((out / "bench.json").read_text())["results"]
    assert result["output_tokens"] == 8 and result["short_outputs"] == 0
    assert result["ratio"] == 1.0 and result["output_tok_s"] > 0
    # The hand count of test_bytes_moved_of_tiny_qwen3_by_hand, over the reported run's time.
    assert result["bytes_moved"] == 1_748_992
    assert result["gb_s"] == pytest.approx(1_748_992 / result["time_s"] / 1e9)
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if "ratio vs atom" in line)
    assert re.search(r"out tok/s +GB/s +total tok/s", lines[header])
    assert f"{result['gb_s']:,.2f}" in lines[header + 2].split()  # the row below the rule
    runs = result["output_tok_s_runs"]
    assert result["repeats"] == 3 and len(runs) == 3
    # The median run; with the profile, of the two runs after the traced first one.
    assert result["output_tok_s"] == (min(runs[1:]) if profile else sorted(runs)[1])
    assert len(result.get("output_tok_s_rounds", [])) == (0 if profile else 2)
    profiles = sorted(p.name for p in (out / "profiles").glob("*")) if profile else []
    assert profiles == (["tiny.atom.2x8-4.trace.json.gz", "tiny.atom.2x8-4.txt"] if profile else [])
    if profile:  # a CPU run records no kernels, and the summary says so
        assert "no GPU kernels in the trace" in printed


def test_atom_bench_prints_the_window_only_kv_saving(tmp_path, capsys, monkeypatch):
    """tiny-gpt-oss: one full layer and one of window 16; 2x40->24 runs 64-token
    sequences in 16-token pages: 4 full pages and 2 window pages of one layer each, where
    the full layout needs 4 pages of both layers."""
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in sys.path if p))
    out = tmp_path / "out"
    argv = ["bench", "--engines", "atom", "--shapes", "tiny-gpt-oss", "--workloads", "2x40->24"]
    main(argv + ["--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out)])
    (result,) = json.loads((out / "bench.json").read_text())["results"]
    assert result["kv_groups"] == "1 full-attention layer, 1 sliding-window(16) layer"
    assert result["context_len"] == 64
    # One layer's page: 16 tokens x 2 KV heads x 32 dims x (K, V) x 4 bytes = 8 KiB.
    assert result["kv_bytes_per_token"] == 6 * 8192 / 64
    assert result["kv_bytes_per_token_full_layout"] == 4 * 2 * 8192 / 64
    assert result["kv_saving"] == pytest.approx(8 / 6, abs=1e-3)
    assert "KV cache 768 bytes/token at 64 tokens" in capsys.readouterr().out


def test_a_failing_engine_is_reported_and_fails_the_command(tmp_path, capsys, monkeypatch):
    """A broken host (here a stand-in vllm package that cannot import) leaves an error row
    in the JSON, its log tail on screen, and a non-zero exit."""
    fake = tmp_path / "fake-site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('stand-in vllm for the test')\n")
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in sys.path if p))
    out = tmp_path / "out"
    argv = ["bench", "--engines", "vllm", "--shapes", "tiny", "--workloads", "1x8->4"]
    argv += ["--device", "cpu", "--vllm-path", str(fake.parent)]
    argv += ["--work", str(tmp_path / "work"), "--out", str(out)]
    with pytest.raises(SystemExit, match="some runs failed"):
        main(argv)
    assert "stand-in vllm for the test" in capsys.readouterr().out
    (result,) = json.loads((out / "bench.json").read_text())["results"]
    assert "error" in result and "output_tok_s" not in result


def test_profile_summary_counts_overlapping_kernels_once(tmp_path):
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("gemm", 0, 60),
        kernel("attention", 50, 20),  # overlaps gemm by 10 us on another stream
        kernel("gemm", 100, 40),  # 30 us idle before it
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90, "dur": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "prepare inputs", "ts": 0, "dur": 30},
        {"ph": "X", "cat": "user_annotation", "name": "prepare inputs", "ts": 95, "dur": 10},
    ]
    path = tmp_path / "run.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    lines = summarize([path]).splitlines()
    assert lines[0].startswith("GPU span 0.1 ms, busy 0.1 ms (79%)")  # 110 of 140 us
    assert "kernel launches from the host 1, CUDA graph launches 1" in lines[0]
    gemm, attention = lines[2].split(), lines[3].split()
    assert gemm[:3] == ["gemm", "2", "0.10"] and gemm[3] == "83.3%"
    assert attention[:3] == ["attention", "1", "0.02"]
    assert lines[4].split()[:2] == ["host", "range"]
    assert lines[5].split() == ["prepare", "inputs", "2", "0.04", "20.0"]
