"""SGLang engines run one after another in one process; one JSON line per engine.

Run as `python sglang_job.py job.json`. A start costs 20-45 s here, and SGLang's own
import a good part of it, so one process runs several engines in turn (each engine's
scheduler is a fresh subprocess, which reads the environment set for it here). The job
file holds a list of runs:

    [{"name": str, "model": path, "engine": {Engine kwargs}, "env": {VAR: value},
      "max_tokens": n, "rounds": [{"name": str, "prompts": [[token ids], ...]}, ...],
      "check": {"streams": [[token ids], ...], "top_k": k}}]

Before each engine, `ATOM_JOB_BEGIN <name>` is printed (to split the log); after it,
`ATOM_JOB_RESULT {...}` with the run's name and, per round, each prompt's generated
token ids and SGLang's `cached_tokens`, and (with "check") each stream's prompt logprobs,
as `atom bench check`'s SGLang job reports them (`atom.testing.bench_check`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

BEGIN_TAG = "ATOM_JOB_BEGIN "
RESULT_TAG = "ATOM_JOB_RESULT "


def run(spec: dict) -> dict:
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(model_path=spec["model"], **spec["engine"])
    init_s = time.perf_counter() - started
    params = {"temperature": 0.0, "max_new_tokens": spec["max_tokens"], "ignore_eos": True}
    rounds = {}
    check = None
    try:
        for r in spec["rounds"]:
            outputs = engine.generate(input_ids=r["prompts"], sampling_params=params)
            rounds[r["name"]] = [
                {
                    "token_ids": list(o["output_ids"]),
                    "cached_tokens": o["meta_info"].get("cached_tokens", 0),
                }
                for o in outputs
            ]
        if spec.get("check"):
            from atom.bench.driver import sglang_prompt_logprobs
            from atom.bench.teacher_forcing import to_json

            streams, top_k = spec["check"]["streams"], spec["check"]["top_k"]
            check = to_json(sglang_prompt_logprobs(engine, streams, top_k))
    finally:
        engine.shutdown()
    return {"name": spec["name"], "rounds": rounds, "init_s": init_s, "check": check}


def main(job_path: str) -> None:
    base_env = dict(os.environ)
    for spec in json.loads(Path(job_path).read_text()):
        os.environ.clear()
        os.environ.update(base_env, **spec["env"])
        print(BEGIN_TAG + spec["name"], flush=True)
        try:
            result = run(spec)
        except Exception as exc:  # the next engines still run; the test reports this one
            result = {"name": spec["name"], "error": repr(exc)}
        print(RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
