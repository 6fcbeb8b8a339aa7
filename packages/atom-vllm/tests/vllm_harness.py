"""Helpers of the atom-vllm tests: tiny checkpoints and vLLM engine jobs.

The end-to-end tests (marker `slow`) start real vLLM engines in subprocesses, one per
engine configuration (`vllm_job.py`), at most `ATOM_VLLM_TEST_JOBS` (default: 2, one per
core) at a time, each engine's worker bound to its own core.
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
JOB_SCRIPT = HERE / "vllm_job.py"
RESULT_TAG = "ATOM_JOB_RESULT "
VOCAB = 512


# --------------------------------------------------------------------------- checkpoints


def tiny_config(architecture: str):
    """A tiny random HF config for `architecture` (head_dim 32: vLLM's CPU kernel needs >= 32)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if architecture == "LlamaForCausalLM":
        return transformers.LlamaConfig(**common)
    if architecture == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(**common)
    if architecture == "Qwen3MoeForCausalLM":
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if architecture == "MixtralForCausalLM":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        mla = dict(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
        if architecture == "DeepseekV2ForCausalLM":
            return transformers.DeepseekV2Config(**mla)
        # V3: q-LoRA, group-limited routing with a scaling factor, yarn rope with mscale.
        yarn = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "rope_theta": 10000.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        }
        return transformers.DeepseekV3Config(
            **{**mla, "q_lora_rank": 48},
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=yarn,
        )
    if architecture == "GPT2LMHeadModel":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=512
        )
    raise KeyError(architecture)


def write_checkpoint(architecture: str, folder: Path, seed: int = 0, init_std: float = 0.1) -> Path:
    """Saves a random fp32 model for `architecture` (safetensors + config.json)."""
    import torch
    import transformers

    config = tiny_config(architecture)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than HF's 0.02: fewer near-ties in the logits
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, init_std)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


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


@dataclass
class JobResult:
    name: str
    rounds: dict[str, list[dict[str, Any]]]
    probe: list[dict[str, Any]] | None
    log: str
    wall_s: float
    init_s: float


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
    }
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
    return JobResult(job.name, data["rounds"], data.get("probe"), log, wall, data["init_s"])


def run_jobs(jobs: list[Job], workdir: Path, timeout: float = 600) -> dict[str, JobResult]:
    """Runs the jobs, `ATOM_VLLM_TEST_JOBS` at a time; failures are returned, not raised."""
    cores = os.cpu_count() or 1
    parallel = max(1, int(os.environ.get("ATOM_VLLM_TEST_JOBS", min(2, cores))))
    workdir.mkdir(parents=True, exist_ok=True)
    free_cores: queue.Queue[int | None] = queue.Queue()
    for i in range(parallel):  # one core per running engine's worker
        free_cores.put(i % cores if parallel > 1 else None)

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


# --------------------------------------------------------------------------- the rounds

# Every equality engine: fp32, prefix caching on, chunked prefill with a 48-token budget.
PREFIX_BLOCKS = 3
BLOCK_SIZE = 16
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
    batch = make_prompts([3, 9, 21, 40, 75, 130], seed)
    prefix = make_prompts([PREFIX_BLOCKS * BLOCK_SIZE], seed + 1)[0]
    suffixes = make_prompts([5, 1, 7, 20], seed + 2)
    return [
        {"name": "batch", "prompts": batch},
        {"name": "prefix_warm", "prompts": [prefix + suffixes[0]]},
        {"name": "prefix_reuse", "prompts": [prefix + s for s in suffixes[1:]]},
    ]
