"""One vLLM engine, several rounds of greedy generation, one JSON line on stdout.

Run as `python vllm_job.py job.json` (the tests start one such process per engine
configuration, because an engine start costs 20-45 s here). The job file holds:

    {"model": path, "engine": {LLM kwargs}, "max_tokens": n, "probe": bool,
     "rounds": [{"name": str, "prompts": [[token ids], ...]}, ...], "lora": path,
     "check": {"streams": [[token ids], ...], "top_k": k}}

("lora", optional: a PEFT adapter every round generates with; the engine needs
`enable_lora`.)

The result line is `ATOM_JOB_RESULT {...}` with, per round, each prompt's generated
token ids and `num_cached_tokens`, vLLM's speculative-decoding counters (`spec_decode`,
engines with `disable_log_stats=False` only), and (with "probe") what each worker actually built
(`atom_vllm.report.describe_model` through `LLM.apply_model`, which needs
VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the environment), and (with "check") each
stream's prompt logprobs, as `atom bench check`'s vLLM job reports them
(`atom.testing.bench_check`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RESULT_TAG = "ATOM_JOB_RESULT "


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    started = time.perf_counter()
    llm = LLM(model=job["model"], **job["engine"])
    init_s = time.perf_counter() - started
    params = SamplingParams(
        max_tokens=job.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
    )
    lora = None
    if job.get("lora"):
        from vllm.lora.request import LoRARequest

        lora = LoRARequest("adapter", 1, job["lora"])
    rounds = {}
    generate_s = 0.0
    for spec in job["rounds"]:
        t = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in spec["prompts"]],
            params,
            use_tqdm=False,
            lora_request=lora,
        )
        generate_s += time.perf_counter() - t
        rounds[spec["name"]] = [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens or 0,
            }
            for o in outputs
        ]
    result = {"rounds": rounds, "init_s": init_s, "generate_s": generate_s}
    if not job["engine"].get("disable_log_stats", True):
        result["spec_decode"] = {
            m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None) or m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_")
        }
    if job.get("check"):
        from atom.bench.driver import vllm_prompt_logprobs
        from atom.bench.teacher_forcing import to_json

        check = job["check"]
        positions = vllm_prompt_logprobs(llm, SamplingParams, check["streams"], check["top_k"])
        result["check"] = to_json(positions)
    if job.get("probe"):
        from atom_vllm.report import describe_model

        result["probe"] = llm.apply_model(describe_model)
    print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
