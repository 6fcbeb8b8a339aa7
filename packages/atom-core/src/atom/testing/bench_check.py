"""`atom bench check` on the CPU for the host suites' family-wide checks.

Most families are checked inside the host suites' own engine jobs: a job that already
runs a family's checkpoint also reads `check_streams` with prompt logprobs
(`atom.bench.driver.vllm_prompt_logprobs` / `sglang_prompt_logprobs`, what the command's
host jobs run), and `check_against_hf` scores its positions against HF transformers in
float32 as the command does; an engine start is 20-45 s here, the check's own share of
a job a second. `run_check` runs the command itself end to end.

Each shape of `run_check` starts its own host engine (20-45 s on two cores), one after another within a
command, so the shapes are dealt over a few `atom bench check` commands that run at once,
one per environment the caller gives (a host suite pins each to its own core). An engine
start keeps only part of a second core busy: two commands took the vLLM suite's check
from 466 s to 347 s here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from atom.bench.driver import HfEngine
from atom.bench.teacher_forcing import compare, from_json, verdict
from atom.bench.workloads import make_prompts, parse_workloads

STREAMS = "2x40"  # the command's --streams on the CPU: 78 positions
TOP_K = 5  # the command's default --top-k


class CheckFailed(AssertionError):
    pass


def run_check(
    shapes: list[str],
    engine: str,
    options: list[str],
    work: Path,
    envs: list[dict[str, str]],
    timeout: float = 1800,
) -> list[dict]:
    """Every row of `atom bench check --device cpu --engines engine --streams STREAMS` over
    `shapes` (`options`: more of its flags), with the shapes dealt round-robin over one
    command per environment of `envs`, all at once. A command that fails raises
    CheckFailed with the tail of its output."""
    groups = [shapes[i :: len(envs)] for i in range(len(envs))]

    def check(index: int) -> list[dict]:
        out = work / f"out{index}"
        command = [sys.executable, "-m", "atom.cli", "bench", "check", "--device", "cpu"]
        command += ["--engines", engine, "--shapes", ",".join(groups[index]), "--streams", STREAMS]
        command += [*options, "--work", str(work / f"work{index}"), "--out", str(out)]
        proc = subprocess.run(
            command, env=envs[index], capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise CheckFailed(
                f"atom bench check {groups[index]} failed (rc={proc.returncode}):\n"
                + proc.stdout[-6000:]
                + proc.stderr[-3000:]
            )
        return json.loads((out / "check.json").read_text())["rows"]

    busy = [i for i, group in enumerate(groups) if group]
    with ThreadPoolExecutor(len(busy)) as pool:
        return [row for rows in pool.map(check, busy) for row in rows]


def check_streams(model: Path) -> list[list[int]]:
    """The random token streams the command feeds a checkpoint's engines (seed 0)."""
    config = json.loads((Path(model) / "config.json").read_text())
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]
    (workload,) = parse_workloads(f"{STREAMS}->1")
    return make_prompts(workload, vocab_size)


def check_against_hf(model: Path, positions: list[list[list]]) -> dict:
    """The command's row for an engine's positions on `check_streams(model)` (as its job
    reported them, `to_json`) against HF transformers in float32 on the same checkpoint,
    run here: the float32 verdict (`passed`) and the agreement figures."""
    hf = HfEngine({"model": str(model), "device": "cpu", "dtype": "float32"})
    reference = hf.prompt_logprobs(check_streams(model), TOP_K)
    metrics = compare(from_json(positions), reference)
    passed, bound = verdict(metrics, None, 1)
    return dict(passed=passed, bound=bound, **metrics)
