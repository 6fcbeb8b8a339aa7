"""`atom bench check`: teacher-forced logprobs against HF transformers, the bounds that
decide a pass, a deliberately broken ATOM model failing it, and one CPU run of the
command."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from atom.bench.driver import AtomEngine, HfEngine
from atom.bench.teacher_forcing import (
    FLOAT32_MEAN_DIFF,
    Position,
    compare,
    decisive_margin,
    from_entries,
    verdict,
)
from atom.bench.workloads import Workload, make_prompts
from atom.cli import main
from atom.registry import all_models
from atom.testing import VOCAB, tiny_config, write_checkpoint
from atom.testing.hf_references import skip_without_hf_reference


def test_from_entries_aligns_each_position_with_the_next_token():
    stream = [5, 7, 9]
    entries = [None, {7: -0.5, 3: -0.2}, {9: -3.0, 4: -0.1, 7: -1.0}]
    first, second = from_entries(entries, stream)
    assert first == Position(-0.5, [(3, -0.2), (7, -0.5)])
    assert second.target == -3.0 and second.top[0] == (4, -0.1)
    with pytest.raises(ValueError, match="2 prompt logprob entries for a 4-token stream"):
        from_entries(entries, stream + [1])


def _positions(targets, tops):
    return [[Position(t, top) for t, top in zip(targets, tops)]]


def test_compare_counts_top1_decisive_positions_and_the_worst_difference():
    want = _positions([-1.0, -2.0, -3.0], [[(1, -0.1), (2, -0.15)], [(1, -0.1), (2, -1.0)]] * 2)
    got = _positions([-1.0, -2.5, -3.1], [[(2, -0.1), (1, -0.15)], [(1, -0.1), (2, -1.0)]] * 2)
    m = compare(got, want)
    assert m["positions"] == 3 and m["top1_agreement"] == pytest.approx(1 / 3)
    # Position 0 is a near tie (0.05 apart): not decisive, so its flip does not count there.
    assert m["decisive_positions"] == 1 and m["decisive_flips"] == 0
    assert m["mean_abs_diff"] == pytest.approx(0.2) and m["max_abs_diff"] == pytest.approx(0.5)
    assert m["worst_position"] == [0, 1]


def test_verdict_bounds_come_from_the_floor():
    good = dict(mean_abs_diff=0.05, top1_agreement=0.94, decisive_positions=100, decisive_flips=0)
    floor = dict(mean_abs_diff=0.03, top1_agreement=0.95)
    assert verdict(good, floor, noise_sources=1)[0]  # 0.05 <= 2 * 0.03 + 0.01
    assert not verdict(good | dict(mean_abs_diff=0.08), floor, noise_sources=1)[0]
    assert verdict(good | dict(mean_abs_diff=0.08), floor, noise_sources=2)[0]
    # Decisive flips: one, plus 2% of the decisive positions.
    assert verdict(good | dict(decisive_flips=3), floor, noise_sources=2)[0]
    assert not verdict(good | dict(decisive_flips=4), floor, noise_sources=2)[0]
    assert verdict(good | dict(decisive_positions=3, decisive_flips=1), floor, 1)[0]
    # top-1 bound: 1 - 0.05 per rounding side - 0.02
    assert not verdict(good | dict(top1_agreement=0.92), floor, noise_sources=1)[0]
    assert verdict(good | dict(top1_agreement=0.92), floor, noise_sources=2)[0]
    # float32 against float32: only accumulation order may differ.
    assert not verdict(good, None, noise_sources=1)[0]
    assert verdict(good | dict(mean_abs_diff=FLOAT32_MEAN_DIFF / 2, top1_agreement=1.0), None, 1)[0]
    assert decisive_margin(floor) == pytest.approx(0.12) and decisive_margin(None) == 0.1


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    return write_checkpoint(tiny_config("Qwen3ForCausalLM"), folder, init_std=0.1)


def _teacher_forced(checkpoint, stream_len: int = 48) -> tuple[dict, tuple[bool, str]]:
    """ATOM's engine against HF, teacher-forced in float32 on the CPU (two streams)."""
    job = dict(model=str(checkpoint), device="cpu", max_model_len=stream_len + 1, options={})
    streams = make_prompts(Workload(2, stream_len, 1), VOCAB, seed=0)
    want = HfEngine(job).prompt_logprobs(streams, 4)
    got = AtomEngine(job).prompt_logprobs(streams, 4)
    metrics = compare(got, want)
    return metrics, verdict(metrics, None, noise_sources=1)


@pytest.mark.parametrize("entry", all_models(), ids=lambda entry: entry.architecture)
def test_every_family_passes_the_check_on_the_cpu(tmp_path, entry):
    """The check `atom bench check` runs on the GPU, here in float32 for every registered
    architecture: ATOM's engine (prompt logprobs through paged KV) against HF's forward.
    The streams run past tiny-gpt-oss's 16-token window."""
    skip_without_hf_reference(entry.architecture)
    folder = write_checkpoint(tiny_config(entry.architecture), tmp_path, init_std=0.1)
    metrics, (ok, bound) = _teacher_forced(folder, stream_len=40)
    assert ok, (metrics, bound)


def test_atom_passes_against_hf(qwen3_checkpoint):
    metrics, (ok, bound) = _teacher_forced(qwen3_checkpoint)
    assert ok, (metrics, bound)
    assert metrics["positions"] == 94 and metrics["decisive_positions"] > 47


def _rope_of_theta_100(rotary_dim, max_position, rope_theta, rope_scaling):
    from atom.kernels import compute_cos_sin_cache

    return compute_cos_sin_cache(rotary_dim, max_position, 100.0, rope_scaling)


def _mlp_without_up_projection(self, x):
    gate = x[..., : x.shape[-1] // 2]
    return torch.nn.functional.silu(gate)


@pytest.mark.parametrize(
    "target, broken",
    [
        ("atom.layers.rotary.compute_cos_sin_cache", _rope_of_theta_100),
        ("atom.layers.activation.SiluAndMul.forward", _mlp_without_up_projection),
    ],
    ids=["wrong-rope-theta", "dropped-up-projection"],
)
def test_a_broken_model_fails(qwen3_checkpoint, monkeypatch, target, broken):
    monkeypatch.setattr(target, broken)
    metrics, (ok, _) = _teacher_forced(qwen3_checkpoint)
    assert not ok
    assert metrics["mean_abs_diff"] > 50 * FLOAT32_MEAN_DIFF


def test_atom_bench_check_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in sys.path if p))
    out = tmp_path / "out"
    argv = ["bench", "check", "--engines", "atom", "--shapes", "tiny", "--streams", "2x32"]
    main(argv + ["--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out)])
    printed = capsys.readouterr().out
    (row,) = json.loads((out / "check.json").read_text())["rows"]
    assert row["engine"] == "atom" and row["reference"] == "hf-float32" and row["passed"]
    assert row["positions"] == 62
    assert "atom vs hf-float32: mean |dlogp| <= 0.002" in printed


def test_atom_bench_check_rejects_bad_options(tmp_path):
    argv = ["bench", "check", "--device", "cpu", "--work", str(tmp_path), "--out", str(tmp_path)]
    for bad in (["--streams", "2x1"], ["--top-k", "1"], ["--streams", "1x99999"]):
        with pytest.raises(SystemExit):
            main(argv + ["--shapes", "tiny"] + bad)
