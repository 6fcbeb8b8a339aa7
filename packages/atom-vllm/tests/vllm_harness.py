"""Helpers of the atom-vllm tests: tiny checkpoints and vLLM engine jobs.

The end-to-end tests (marker `slow`) start real vLLM engines in subprocesses, one per
engine configuration (`vllm_job.py`), at most `ATOM_VLLM_TEST_JOBS` (default: 2, one per
core) at a time, each engine's worker bound to its own core.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atom.testing import random_prompts
from atom.testing.bench_check import TOP_K as CHECK_TOP_K
from atom.testing.bench_check import check_against_hf, check_streams

HERE = Path(__file__).parent
JOB_SCRIPT = HERE / "vllm_job.py"
RESULT_TAG = "ATOM_JOB_RESULT "


# --------------------------------------------------------------------------- checkpoints


def write_lora_adapter(model: Path, out: Path, rank: int = 8, seed: int = 0) -> Path:
    """A PEFT LoRA adapter for a tiny Llama-shaped checkpoint: random A and B on every
    layer's q_proj and v_proj, large enough to change greedy tokens."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, width in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, rank, generator=generator)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(outputs),
        "bias": "none",
        "base_model_name_or_path": str(model),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter))
    return out


# --------------------------------------------------------------------------- engine jobs


@dataclass
class Job:
    """One vLLM engine run (`vllm_job.py`): LLM kwargs, env, rounds of prompts."""

    name: str
    model: Path
    engine: dict[str, Any]
    rounds: list[dict[str, Any]]
    env: dict[str, str] = field(default_factory=dict)
    max_tokens: int = 8
    probe: bool = True
    lora: Path | None = None  # a PEFT adapter every round generates with
    check: bool = False  # also `atom bench check`'s streams (atom.testing.bench_check)


@dataclass
class JobResult:
    name: str
    rounds: dict[str, list[dict[str, Any]]]
    probe: list[dict[str, Any]] | None
    log: str
    wall_s: float
    init_s: float
    spec_decode: dict[str, Any] | None = None
    check: list | None = None  # the check streams' positions (teacher_forcing.to_json)


class JobFailed(AssertionError):
    pass


def engine_env(tmp: Path, extra: dict[str, str], core: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ATOM_DISABLE_VLLM_PLUGIN", None)
    env.update(
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # LLM.apply_model(describe_model)
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="INFO",
        PYTHONHASHSEED="0",
        # The engine core in the job's own process: half an engine start's CPU time here
        # (41 s -> 22 s for a Llama job), as the core process re-imports vLLM and torch.
        # test_vllm_llm keeps vLLM's processes in the runs that check them.
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    if core is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    env.update(extra)
    return env


def _run_job(job: Job, workdir: Path, core: int | None, timeout: float) -> JobResult:
    spec = {
        "model": str(job.model),
        "engine": job.engine,
        "rounds": job.rounds,
        "max_tokens": job.max_tokens,
        "probe": job.probe,
        "lora": str(job.lora) if job.lora else None,
    }
    if job.check:
        spec["check"] = {"streams": check_streams(job.model), "top_k": CHECK_TOP_K}
    job_file = workdir / f"{job.name}.json"
    job_file.write_text(json.dumps(spec))
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(JOB_SCRIPT), str(job_file)],
        env=engine_env(workdir, job.env, core),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    (workdir / f"{job.name}.log").write_text(log)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise JobFailed(f"vLLM job {job.name} failed (rc={proc.returncode}):\n{log[-6000:]}")
    data = json.loads(lines[-1][len(RESULT_TAG) :])
    return JobResult(
        job.name,
        data["rounds"],
        data.get("probe"),
        log,
        wall,
        data["init_s"],
        data.get("spec_decode"),
        data.get("check"),
    )


def engine_cores() -> list[int | None]:
    """The core of each engine that may run at once (`ATOM_VLLM_TEST_JOBS`, default one
    per core, at most 2): its worker's threads bind there; None (unbound) for one engine."""
    cores = os.cpu_count() or 1
    parallel = max(1, int(os.environ.get("ATOM_VLLM_TEST_JOBS", min(2, cores))))
    return [i % cores for i in range(parallel)] if parallel > 1 else [None]


def run_jobs(jobs: list[Job], workdir: Path, timeout: float = 600) -> dict[str, JobResult]:
    """Runs the jobs, `ATOM_VLLM_TEST_JOBS` at a time; failures are returned, not raised."""
    slots = engine_cores()
    parallel = len(slots)
    workdir.mkdir(parents=True, exist_ok=True)
    free_cores: queue.Queue[int | None] = queue.Queue()
    for core in slots:
        free_cores.put(core)

    def run(job: Job) -> JobResult:
        core = free_cores.get()
        try:
            return _run_job(job, workdir, core, timeout)
        finally:
            free_cores.put(core)

    results: dict[str, Any] = {}
    with ThreadPoolExecutor(parallel) as pool:
        futures = {job.name: pool.submit(run, job) for job in jobs}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as exc:  # reported by the test that needs this job
                results[name] = exc
    return results


def result_of(results: dict[str, Any], name: str) -> JobResult:
    value = results[name]
    if isinstance(value, BaseException):
        raise value
    return value


def assert_passes_the_check(result: JobResult, model: Path) -> None:
    """`atom bench check`'s float32 verdict on a job run with `check=True`: its engine's
    teacher-forced positions against HF transformers on the same checkpoint."""
    row = check_against_hf(model, result.check)
    assert row["passed"] and row["positions"] == 78 and row["top1_agreement"] == 1.0, (
        result.name, row
    )  # fmt: skip


# --------------------------------------------------------------------------- the rounds

# Every equality engine: fp32, prefix caching on, chunked prefill with a 48-token budget
# (below the 96-token shared prefix, so it is prefilled in chunks).
PREFIX_BLOCKS = 3
BLOCK_SIZE = 32  # vLLM's CPU_ATTN (the stock side) takes multiples of 32
BUDGET = 48

ENGINE = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    max_model_len=256,
    enforce_eager=True,
    kv_cache_memory_bytes=32 << 20,
    block_size=BLOCK_SIZE,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=BUDGET,
    max_num_seqs=8,
    seed=0,
)


def rounds(seed: int) -> list[dict]:
    batch = random_prompts([3, 9, 21, 40, 75, 130], seed)
    prefix = random_prompts([PREFIX_BLOCKS * BLOCK_SIZE], seed + 1)[0]
    suffixes = random_prompts([5, 1, 7, 20], seed + 2)
    return [
        {"name": "batch", "prompts": batch},
        {"name": "prefix_warm", "prompts": [prefix + suffixes[0]]},
        {"name": "prefix_reuse", "prompts": [prefix + s for s in suffixes[1:]]},
    ]


def native_greedy(
    model: Path, rounds_: list[dict], max_tokens: int = 8, **engine: Any
) -> dict[str, list[list[int]]]:
    """ATOM's native engine's greedy tokens for each round (fp32, the jobs' block size and
    KV budget, `max_tokens` as the jobs generate)."""
    from atom import LLM, SamplingParams

    llm = LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=ENGINE["kv_cache_memory_bytes"],
        skip_tokenizer_init=True,
        **engine,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return {
        spec["name"]: [
            list(o.outputs[0].token_ids)
            for o in llm.generate(spec["prompts"], params, use_tqdm=False)
        ]
        for spec in rounds_
    }
