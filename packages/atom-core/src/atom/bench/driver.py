"""One engine in its own process: `python -m atom.bench.driver JOB.json`.

Loads the engine once, then per workload runs a warm-up of the same batch shape and the
timed generation (greedy, ignore_eos, fixed output length). Events go to stdout as
`BENCH_EVENT {json}` lines, which the parent shows as progress and collects as results.

The host (vLLM, SGLang) is imported by the name the job gives, in this process only:
`atom` itself never depends on a host (docs/architecture.md); the bench launches hosts as
peers.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from atom.bench.drafter import with_random_drafter
from atom.bench.profile import summarize
from atom.bench.report import median_run
from atom.bench.teacher_forcing import Position, from_entries, from_logprobs, to_json
from atom.bench.workloads import Workload, make_prompts, warmup_workload

EVENT = "BENCH_EVENT "
GREEDY_SAMPLE = 8  # prompts per workload whose tokens go to the report (atom.bench.agreement)


def engine_dtype(device: str) -> str:
    """Every engine runs bfloat16 on a GPU; on the CPU only ATOM runs, in float32."""
    return "float32" if device == "cpu" else "bfloat16"


def job_dtype(job: dict) -> str:
    """The dtype a job asks for (`atom bench check --dtype`), else `engine_dtype`'s."""
    return job.get("dtype") or engine_dtype(job["device"])


def emit(event: str, **fields) -> None:
    print(EVENT + json.dumps({"event": event, **fields}), flush=True)


@contextmanager
def in_process_trace(stem: Path) -> Iterator[list[Path]]:
    """torch.profiler over this process (ATOM; vLLM with its engine core in-process)."""
    from torch.profiler import ProfilerActivity, profile

    files: list[Path] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield files
    path = Path(f"{stem}.trace.json.gz")
    prof.export_chrome_trace(str(path))
    files.append(path)


class AtomEngine:
    def __init__(self, job: dict):
        from atom import LLM, SamplingParams

        self.params = SamplingParams
        kwargs = dict(
            dtype=job_dtype(job),
            device=job["device"],
            max_model_len=job["max_model_len"],
            skip_tokenizer_init=True,
        )
        if job["device"] != "cpu":
            kwargs["gpu_memory_utilization"] = job["gpu_memory_utilization"]
        options = with_random_drafter(job["model"], job["options"])
        self.llm = LLM(model=job["model"], **kwargs, **options)

    def spec_counts(self) -> tuple[int, int, int] | None:
        """(verify steps, drafted tokens, accepted tokens) so far; None without drafts."""
        if self.llm.engine.proposer is None:
            return None
        stats = self.llm.engine.spec_stats
        return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = self.params(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False
        )
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def prompt_logprobs(self, streams: list[list[int]], k: int) -> list[list[Position]]:
        params = self.params(max_tokens=1, prompt_logprobs=k, detokenize=False)
        outputs = self.llm.generate(streams, params, use_tqdm=False)
        return [from_entries(o.prompt_logprobs, s) for o, s in zip(outputs, streams)]

    def kv_report(self, context_len: int) -> dict:
        """KV bytes per token of `context_len`-token sequences, as allocated (sliding-window
        layers keep only their window's pages) and as the full layout would need."""
        return self.llm.engine.kv_layout.report(context_len)

    trace = staticmethod(in_process_trace)


# vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py, 0.32 and 0.33), in
# spec_counts' order, by their names in vLLM's metric namespace.
VLLM_SPEC_COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


class VllmEngine:
    def __init__(self, job: dict):
        vllm = importlib.import_module(job["host"])
        self.params = vllm.SamplingParams
        defaults = dict(
            skip_tokenizer_init=True,
            dtype=job_dtype(job),
            max_model_len=job["max_model_len"],
            gpu_memory_utilization=job["gpu_memory_utilization"],
            seed=0,
        )
        options = with_random_drafter(job["model"], job["options"])
        # vLLM counts drafts only where it keeps stats, which its offline LLM turns off.
        self.speculative = "speculative_config" in options
        if self.speculative:
            defaults["disable_log_stats"] = False
        self.llm = vllm.LLM(model=job["model"], **(defaults | options))

    def spec_counts(self) -> tuple[int, int, int] | None:
        """(verify steps, drafted tokens, accepted tokens) so far, from vLLM's counters;
        None without drafts."""
        if not self.speculative:
            return None
        totals = dict.fromkeys(VLLM_SPEC_COUNTERS, 0)
        for metric in self.llm.get_metrics():
            namespace, _, name = metric.name.partition(":")
            if namespace == "vllm" and name in totals:
                totals[name] += metric.value
        return tuple(totals.values())

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = self.params(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    def prompt_logprobs(self, streams: list[list[int]], k: int) -> list[list[Position]]:
        return vllm_prompt_logprobs(self.llm, self.params, streams, k)

    # The bench runs vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0 when it profiles.
    trace = staticmethod(in_process_trace)


class SglangEngine:
    def __init__(self, job: dict):
        sglang = importlib.import_module(job["host"])
        # SGLang's staged kernels have no FA3: triton attention for its own model, ATOM's
        # backend when the plugin runs.
        backend = "atom" if job["plugin"] else "triton"
        defaults = dict(
            attention_backend=backend,
            sampling_backend="pytorch",
            dtype=job_dtype(job),
            skip_tokenizer_init=True,
            mem_fraction_static=job["gpu_memory_utilization"],
            context_length=job["max_model_len"],
            random_seed=0,
            log_level="warning",
        )
        # --sglang-option KEY=VALUE overrides a default (e.g. log_level=info).
        self.engine = sglang.Engine(model_path=job["model"], **(defaults | job["options"]))

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params)
        return [list(o["output_ids"]) for o in outputs]

    def prompt_logprobs(self, streams: list[list[int]], k: int) -> list[list[Position]]:
        return sglang_prompt_logprobs(self.engine, streams, k)

    @contextmanager
    def trace(self, stem: Path) -> Iterator[list[Path]]:
        """SGLang's scheduler process records the trace (its profiling requests)."""
        files: list[Path] = []
        self.engine.start_profile(
            output_dir=str(stem.parent), profile_prefix=stem.name, activities=["CPU", "GPU"]
        )
        yield files
        self.engine.stop_profile()
        files += sorted(stem.parent.glob(f"{stem.name}-*.trace.json.gz"))

    def close(self) -> None:
        self.engine.shutdown()


def vllm_prompt_logprobs(llm, sampling_params, streams: list[list[int]], k: int):
    """Each stream's positions from a running `vllm.LLM` (its `SamplingParams` class
    given): also what the host suites' engine jobs report for their teacher-forced check."""
    params = sampling_params(max_tokens=1, prompt_logprobs=k, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": s} for s in streams], params, use_tqdm=False)
    return [
        from_entries(
            [row and {t: lp.logprob for t, lp in row.items()} for row in o.prompt_logprobs], s
        )
        for o, s in zip(outputs, streams)
    ]


def sglang_prompt_logprobs(engine, streams: list[list[int]], k: int) -> list[list[Position]]:
    """Each stream's positions from a running `sglang.Engine`."""
    outputs = engine.generate(
        input_ids=streams,
        sampling_params={"temperature": 0.0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=k,
    )
    # (logprob, token, text) tuples; the first position has no logprob, and positions
    # may lack their top list.
    return [
        from_entries(
            [
                None if lp is None else {token: lp} | {t: v for v, t, _ in top or ()}
                for (lp, token, _), top in zip(
                    o["meta_info"]["input_token_logprobs"],
                    o["meta_info"]["input_top_logprobs"],
                )
            ],
            s,
        )
        for o, s in zip(outputs, streams)
    ]


class HfEngine:
    """HF transformers, the reference of `atom bench check`: one forward per stream."""

    def __init__(self, job: dict):
        import torch

        from atom.testing.hf_references import hf_causal_lm_class

        self.device = job["device"]
        # Loaded on the CPU, then moved: a device_map would need `accelerate`.
        self.model = hf_causal_lm_class(job["model"]).from_pretrained(
            job["model"], dtype=getattr(torch, job_dtype(job))
        )
        self.model.to(self.device).eval()

    def prompt_logprobs(self, streams: list[list[int]], k: int) -> list[list[Position]]:
        import torch

        positions = []
        with torch.inference_mode():
            for stream in streams:
                ids = torch.tensor([stream], device=self.device)
                logits = self.model(ids).logits[0, :-1].float()
                positions.append(from_logprobs(logits.log_softmax(-1), stream, k))
        return positions


HOSTS = {
    "atom": AtomEngine,
    "vllm": VllmEngine,
    "sglang": SglangEngine,
    "hf": HfEngine,
}


def timed_run(engine, job: dict, workload: Workload, seed: int, traced: bool) -> dict:
    """One timed generation of `workload` on prompts drawn with `seed`; records a trace
    when `traced` and the job has a profile folder."""
    profile_dir = job.get("profile_dir") if traced else None
    stem = (
        Path(profile_dir) / f"{job['tag']}.{workload.name.replace('->', '-')}"
        if profile_dir
        else None
    )
    prompts = make_prompts(workload, job["vocab_size"], seed)
    with engine.trace(stem) if stem else nullcontext([]) as trace_files:
        t = time.perf_counter()
        outputs = engine.generate(prompts, workload.output_len)
        elapsed = time.perf_counter() - t
    lengths = [len(tokens) for tokens in outputs]
    if stem:
        report = Path(f"{stem}.txt")
        report.write_text(summarize(trace_files))
        emit("profile", workload=workload.name, report=str(report))
    output_tokens = sum(lengths)
    return dict(
        time_s=elapsed,
        output_tokens=output_tokens,
        output_tok_s=output_tokens / elapsed,
        total_tok_s=(output_tokens + workload.num_prompts * workload.input_len) / elapsed,
        short_outputs=sum(n != workload.output_len for n in lengths),
        # Every engine gets the same prompts for a seed: their greedy tokens are compared.
        greedy_sample=outputs[:GREEDY_SAMPLE],
    )


def run(job: dict) -> None:
    started = time.perf_counter()
    engine = HOSTS[job["host"]](job)
    emit("ready", init_s=time.perf_counter() - started)
    if "streams" in job:  # atom bench check: teacher-forced logprobs, no timing
        emit("start", workload="teacher-forced streams")
        positions = engine.prompt_logprobs(job["streams"], job["top_k"])
        emit("logprobs", streams=to_json(positions))
    else:
        run_workloads(engine, job)
    if hasattr(engine, "close"):
        engine.close()


def run_workloads(engine, job: dict) -> None:
    repeats = job["repeats"]
    for spec in job["workloads"]:
        workload = Workload(**spec)
        emit("start", workload=workload.name)
        warm = warmup_workload(workload)
        # Other prompts than the timed ones: the timed runs must not hit the prefix cache.
        engine.generate(
            make_prompts(warm, job["vocab_size"], job["seed"] + repeats), warm.output_len
        )
        counts_before = engine.spec_counts() if hasattr(engine, "spec_counts") else None
        runs = [
            timed_run(engine, job, workload, seed=job["seed"] + i, traced=i == 0)
            for i in range(repeats)
        ]
        # The profiler slows the traced run: the median is of the others where there are.
        untraced = runs[1:] if job.get("profile_dir") and repeats > 1 else runs
        result = median_run(untraced) | {
            "greedy_sample": runs[0]["greedy_sample"],  # the first seed's, as every engine's
            "short_outputs": sum(r["short_outputs"] for r in runs),  # any run's, not hidden
            "repeats": repeats,
            "output_tok_s_runs": [r["output_tok_s"] for r in runs],
        }
        if hasattr(engine, "kv_report"):
            result |= engine.kv_report(workload.input_len + workload.output_len)
        if counts_before is not None:
            steps, drafted, accepted = (b - a for a, b in zip(counts_before, engine.spec_counts()))
            result |= {
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": 1 + accepted / steps if steps else 0.0,
            }
        emit("result", workload=workload.name, **result)


def main() -> None:
    run(json.loads(Path(sys.argv[1]).read_text()))


if __name__ == "__main__":
    main()
