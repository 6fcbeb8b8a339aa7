"""Helpers of the atom-sglang tests: tiny checkpoints, SGLang engine jobs, HF references.

The end-to-end tests start real SGLang CPU engines: a few job processes in parallel (one
per core), each running its engines one after another (`sglang_job.py`), in an
environment prepared by `sglang_cpu_support.engine_env` (the CPU workarounds).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sglang_cpu_support

from atom.testing import random_prompts
from atom.testing.bench_check import TOP_K as CHECK_TOP_K
from atom.testing.bench_check import check_against_hf, check_streams

HERE = Path(__file__).parent
JOB_SCRIPT = HERE / "sglang_job.py"
BEGIN_TAG = "ATOM_JOB_BEGIN "
RESULT_TAG = "ATOM_JOB_RESULT "
MAX_TOKENS = 8

# --------------------------------------------------------------------------- checkpoints

PREFIX_LEN = 48


def rounds(seed: int) -> list[dict]:
    """A mixed-length batch, then a shared prefix: warmed by one request, reused by three."""
    prefix = random_prompts([PREFIX_LEN], seed + 1)[0]
    suffixes = random_prompts([5, 1, 7, 20], seed + 2)
    return [
        {"name": "batch", "prompts": random_prompts([3, 9, 21, 40, 75, 130], seed)},
        {"name": "prefix_warm", "prompts": [prefix + suffixes[0]]},
        {"name": "prefix_reuse", "prompts": [prefix + s for s in suffixes[1:]]},
    ]


# --------------------------------------------------------------------------- engine jobs

ENGINE = dict(
    device="cpu",
    dtype="float32",
    skip_tokenizer_init=True,
    disable_cuda_graph=True,
    mem_fraction_static=0.05,
    max_total_tokens=4096,
    context_length=512,
    chunked_prefill_size=64,
    random_seed=0,
    log_level="info",
)


@dataclass
class Run:
    """One SGLang engine (`sglang_job.py`): Engine kwargs, its env, rounds of prompts."""

    name: str
    model: Path
    engine: dict[str, Any]
    rounds: list[dict[str, Any]]
    env: dict[str, str] = field(default_factory=dict)
    check: bool = False  # also `atom bench check`'s streams (atom.testing.bench_check)


@dataclass
class RunResult:
    name: str
    rounds: dict[str, list[dict[str, Any]]]
    log: str
    check: list | None = None  # the check streams' positions (teacher_forcing.to_json)

    def tokens(self) -> dict[str, list[list[int]]]:
        return {name: [r["token_ids"] for r in outs] for name, outs in self.rounds.items()}


class RunFailed(AssertionError):
    pass


def _run_job(runs: list[Run], workdir: Path, index: int, timeout: float) -> dict[str, Any]:
    """One process running `runs` in turn; {run name: RunResult or RunFailed}."""
    job_file = workdir / f"job{index}.json"
    specs = [
        {
            "name": r.name,
            "model": str(r.model),
            "engine": r.engine,
            "env": r.env,
            "rounds": r.rounds,
            "max_tokens": MAX_TOKENS,
            "check": r.check and {"streams": check_streams(r.model), "top_k": CHECK_TOP_K},
        }
        for r in runs
    ]
    job_file.write_text(json.dumps(specs))
    env = sglang_cpu_support.engine_env(workdir)
    for name in ("ATOM_DISABLE_SGLANG_PLUGIN", "SGLANG_EXTERNAL_MODEL_PACKAGE"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, str(JOB_SCRIPT), str(job_file)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    (workdir / f"job{index}.log").write_text(proc.stdout)
    results: dict[str, Any] = {}
    name, lines = None, []
    for line in proc.stdout.splitlines():
        if line.startswith(BEGIN_TAG):
            name, lines = line[len(BEGIN_TAG) :], []
        elif line.startswith(RESULT_TAG):
            data = json.loads(line[len(RESULT_TAG) :])
            log = "\n".join(lines)
            if "error" in data:
                results[data["name"]] = RunFailed(f"{data['name']}: {data['error']}\n{log[-6000:]}")
            else:
                results[data["name"]] = RunResult(
                    data["name"], data["rounds"], log, data.get("check")
                )
            name = None
        elif name is not None:
            lines.append(line)
    for r in runs:
        results.setdefault(
            r.name, RunFailed(f"{r.name}: no result (rc={proc.returncode})\n{proc.stdout[-6000:]}")
        )
    return results


def run_jobs(jobs: list[list[Run]], workdir: Path, timeout: float = 900) -> dict[str, Any]:
    """Runs each job (a list of engine runs) in its own process, all jobs in parallel;
    returns {run name: RunResult or the exception}, failures are not raised here."""
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_run_job, runs, workdir, i, timeout) for i, runs in enumerate(jobs)]
        for runs, future in zip(jobs, futures):
            try:
                results.update(future.result())
            except Exception as exc:
                results.update({r.name: exc for r in runs})
    return results


def result_of(results: dict[str, Any], name: str) -> RunResult:
    value = results[name]
    if isinstance(value, BaseException):
        raise value
    return value


def assert_passes_the_check(result: RunResult, model: Path) -> None:
    """`atom bench check`'s float32 verdict on a run with `check=True`: its engine's
    teacher-forced positions against HF transformers on the same checkpoint."""
    row = check_against_hf(model, result.check)
    assert row["passed"] and row["positions"] == 78 and row["top1_agreement"] == 1.0, (
        result.name, row
    )  # fmt: skip
