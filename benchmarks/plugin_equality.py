"""What the plugin equality scripts (vllm_plugin.py, sglang_plugin.py) share: tiny fp32
checkpoints, the rounds of prompts, one engine per subprocess, and the command line.

Each script runs itself as `SCRIPT engine JOB.json` in a subprocess per engine; the line
starting with RESULT carries that engine's JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from atom.testing import hf_greedy, random_prompts, tiny_config, write_checkpoint

RESULT = "ENGINE_RESULT "
ARCHITECTURES = ["LlamaForCausalLM", "Qwen3ForCausalLM"]
MAX_TOKENS = 16


def tiny_model(work: Path, architecture: str) -> Path:
    """A tiny fp32 checkpoint of `architecture` (written once per work folder)."""
    folder = work / f"tiny-{architecture}"
    if not (folder / "config.json").exists():
        write_checkpoint(tiny_config(architecture), folder, init_std=0.1)
    return folder


def rounds(index: int) -> list[dict]:
    """A mixed batch, a decode batch, then a shared prefix warmed and reused."""
    prefix = random_prompts([48], 100 + index)[0]
    return [
        {"name": name, "prompts": batch, "max_tokens": MAX_TOKENS}
        for name, batch in (
            ("batch", random_prompts([3, 9, 21, 40, 75, 130], index)),
            ("decode_batch", random_prompts([5] * 8, 50 + index)),
            ("prefix_warm", [prefix + random_prompts([5], 7)[0]]),
            ("prefix_reuse", [prefix + s for s in random_prompts([1, 7, 20], 8)]),
        )
    ]


def token_ids(engine_rounds: dict[str, list[dict]]) -> dict[str, list[list[int]]]:
    """An engine's result rounds as the token ids alone, by round name."""
    return {name: [o["token_ids"] for o in outputs] for name, outputs in engine_rounds.items()}


def hf_rounds(model: Path, job_rounds: list[dict]) -> dict[str, list[list[int]]]:
    """HF transformers' greedy tokens (fp32, on the GPU) for each round, by round name."""
    return {
        r["name"]: hf_greedy(model, r["prompts"], r["max_tokens"], device="cuda")
        for r in job_rounds
    }


def print_differences(name: str, tokens: dict, reference: dict) -> None:
    for round_name, outputs in reference.items():
        for j, (want, got) in enumerate(zip(outputs, tokens[round_name])):
            if got != want:
                print(f"  {round_name}[{j}] atom={got} {name}={want}", flush=True)


def selected(covered: list[str], only: list[str] | None) -> list[tuple[int, str]]:
    """(index, architecture) for each of `covered` that --arch asks for (all without it);
    the index, which seeds the prompts, is the one a full run gives it."""
    unknown = sorted(set(only or ()) - set(covered))
    if unknown:
        raise SystemExit(f"--arch {', '.join(unknown)}: this script covers {', '.join(covered)}")
    return [(i, arch) for i, arch in enumerate(covered) if not only or arch in only]


def run_in_subprocess(
    script: str, job: dict, env: dict[str, str], work: Path, name: str, mode: str
) -> tuple[dict, str]:
    """Runs `script engine JOB` for one engine; (its result or {"failed": True}, its log)."""
    job_file = work / f"{name}.{mode}.json"
    job_file.write_text(json.dumps(job))
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, script, "engine", str(job_file)], env=env, capture_output=True, text=True
    )
    log = proc.stdout + proc.stderr
    (work / f"{name}.{mode}.log").write_text(log)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode or not lines:
        print(f"RESULT {name} {mode} FAILED rc={proc.returncode}\n{log[-4000:]}", flush=True)
        return {"failed": True}, log
    result = json.loads(lines[-1][len(RESULT) :])
    result["wall_s"] = time.perf_counter() - t
    return result, log


def main(
    name: str,
    run_engine: Callable[[dict], dict],
    equality: Callable[[Path, dict, list[str] | None], bool],
    default_work: str,
) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["equality", "engine"])
    parser.add_argument("job", nargs="?")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--work", default=default_work)
    parser.add_argument(
        "--arch", action="append", help="only this architecture (repeatable; default: all)"
    )
    args = parser.parse_args()
    if args.what == "engine":
        print(RESULT + json.dumps(run_engine(json.loads(Path(args.job).read_text()))), flush=True)
        return
    out_dir, work = Path(args.out), Path(args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    ok = False
    try:
        ok = equality(work, summary, args.arch)
    finally:
        (out_dir / f"{name}_equality.json").write_text(json.dumps(summary))
        with tarfile.open(out_dir / f"{name}_equality_logs.tar.gz", "w:gz") as tar:
            for log in sorted(work.glob("*.log")):
                tar.add(log, arcname=log.name)
    sys.exit(0 if ok else 1)
