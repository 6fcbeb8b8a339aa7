"""vLLM with atom-vllm vs vLLM alone on a GPU: greedy equality with CUDA graphs.

    python benchmarks/vllm_plugin.py equality [--out DIR]   # tiny fp32 Llama/Qwen3

Throughput is `atom bench --engines vllm,vllm-atom` (atom/bench), which also runs the
native engine and SGLang on the same checkpoints and prompts.

Checkpoints, job files and engine logs go to --work (default /tmp/atom-vllm-bench);
--out gets one JSON summary and a tar.gz of the logs.

Each engine runs in its own process (`engine` subcommand), with the plugin on
("atom") or off ("vllm"), in the environment `atom bench` gives those engines (the
plugin's entry point comes from a shim, so a source checkout on PYTHONPATH is enough),
same checkpoint, same prompts (random token ids, ignore_eos). Lines starting with RESULT
carry the figures; JSON goes to --out. Checkpoints have random weights written here with
transformers.

CUDA graphs on (enforce_eager=False; no torch.compile, FULL_DECODE_ONLY graphs, so both
sides capture their decode steps), prefix caching, chunked prefill (48-token budget);
ATOM's kernels are Triton there (the kernel policy's choice on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from atom.bench.engines import ENGINES, engine_env
from atom.testing import tiny_config, write_checkpoint

RESULT = "ENGINE_RESULT "
MODES = {"atom": ENGINES["vllm-atom"], "vllm": ENGINES["vllm"]}


# ---------------------------------------------------------------- one engine (subprocess)


def run_engine(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=job["model"], **job["engine"])
    out = {"init_s": time.perf_counter() - started, "rounds": {}, "round_s": {}}
    for spec in job["rounds"]:
        params = SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
        )
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        out["round_s"][spec["name"]] = time.perf_counter() - t
        out["rounds"][spec["name"]] = [
            {"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
            for o in outputs
        ]
    try:
        from atom_vllm.report import describe_model

        out["probe"] = llm.apply_model(describe_model)
    except Exception as exc:  # plugin off / apply_model refused
        out["probe"] = repr(exc)
    config = llm.llm_engine.vllm_config.compilation_config
    out["cudagraph_mode"] = str(config.cudagraph_mode)
    out["compilation_mode"] = str(config.mode)
    return out


def engine(job: dict, mode: str, work: Path, name: str) -> dict:
    env = engine_env(MODES[mode], {}, work)
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function
    job_file = work / f"{name}.{mode}.json"
    job_file.write_text(json.dumps(job))
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "engine", str(job_file)],
        env=env,
        capture_output=True,
        text=True,
    )
    (work / f"{name}.{mode}.log").write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = (proc.stdout + proc.stderr)[-4000:]
        print(f"RESULT {name} {mode} FAILED rc={proc.returncode}\n{tail}", flush=True)
        return {"failed": True}
    result = json.loads(lines[-1][len(RESULT) :])
    result["wall_s"] = time.perf_counter() - t
    return result


# ---------------------------------------------------------------- checkpoints


def prompts(lengths, seed, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- equality


def equality(work: Path, summary: dict) -> bool:
    engine_kw = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=False,
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
        gpu_memory_utilization=0.2,
        block_size=16,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        seed=0,
    )
    ok = True
    for i, arch in enumerate(["LlamaForCausalLM", "Qwen3ForCausalLM"]):
        model = work / f"tiny-{arch}"
        if not (model / "config.json").exists():
            write_checkpoint(tiny_config(arch), model, init_std=0.1)
        prefix = prompts([48], 100 + i, 512)[0]
        rounds = [
            {"name": "batch", "prompts": prompts([3, 9, 21, 40, 75, 130], i, 512)},
            {"name": "decode_batch", "prompts": prompts([5] * 8, 50 + i, 512)},
            {"name": "prefix_warm", "prompts": [prefix + prompts([5], 7, 512)[0]]},
            {"name": "prefix_reuse", "prompts": [prefix + s for s in prompts([1, 7, 20], 8, 512)]},
        ]
        for r in rounds:
            r["max_tokens"] = 16
        job = {"model": str(model), "engine": engine_kw, "rounds": rounds}
        res = {m: engine(job, m, work, f"eq-{arch}") for m in MODES}
        summary[f"equality-{arch}"] = res
        if any(r.get("failed") for r in res.values()):
            ok = False
            continue
        same = res["atom"]["rounds"] == res["vllm"]["rounds"]
        ok &= same
        probe = res["atom"]["probe"]
        backends = sorted({x["backend_name"] for w in probe for x in w["attention"]})
        calls = sum(x["calls"] or 0 for w in probe for x in w["attention"])
        print(
            f"RESULT equality {arch} tokens_equal={same} "
            f"atom_model={probe[0]['atom_class']} backends={backends} atom_impl_calls={calls} "
            f"cudagraph_mode={res['atom']['cudagraph_mode']} "
            f"cached={[r['num_cached_tokens'] for r in res['atom']['rounds']['prefix_reuse']]}",
            flush=True,
        )
        if not same:
            for name in res["vllm"]["rounds"]:
                a, v = res["atom"]["rounds"][name], res["vllm"]["rounds"][name]
                for j, (x, y) in enumerate(zip(a, v)):
                    if x != y:
                        print(f"  {name}[{j}] atom={x['token_ids']} vllm={y['token_ids']}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["equality", "engine"])
    parser.add_argument("job", nargs="?")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--work", default="/tmp/atom-vllm-bench")
    args = parser.parse_args()
    if args.what == "engine":
        print(RESULT + json.dumps(run_engine(json.loads(Path(args.job).read_text()))), flush=True)
        return
    out_dir, work = Path(args.out), Path(args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    ok = True
    try:
        ok = equality(work, summary)
    finally:
        (out_dir / f"vllm_plugin_{args.what}.json").write_text(json.dumps(summary))
        with tarfile.open(out_dir / f"vllm_plugin_{args.what}_logs.tar.gz", "w:gz") as tar:
            for log in sorted(work.glob("*.log")):
                tar.add(log, arcname=log.name)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
