"""vLLM with atom-vllm vs vLLM alone on a GPU: greedy equality with CUDA graphs, throughput.

    python benchmarks/vllm_plugin.py equality   [--out DIR]   # tiny fp32 Llama/Qwen3
    python benchmarks/vllm_plugin.py throughput [--out DIR]   # Qwen3-0.6B shape, bf16

Checkpoints, job files and engine logs go to --work (default /tmp/atom-vllm-bench);
--out gets one JSON summary and a tar.gz of the logs.

Each engine runs in its own process (`engine` subcommand), with the plugin on
("atom") or off ("vllm": ATOM_DISABLE_VLLM_PLUGIN=1), same checkpoint, same prompts
(random token ids, ignore_eos). Lines starting with RESULT carry the figures; JSON goes
to --out. Checkpoints have random weights written here with transformers.

equality: CUDA graphs on (enforce_eager=False; no torch.compile, FULL_DECODE_ONLY graphs,
so both sides capture their decode steps), prefix caching, chunked prefill (48-token
budget); ATOM's kernels are Triton there (the kernel policy's choice on CUDA).
throughput: each side with vLLM's default compilation / CUDA-graph settings.
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

RESULT = "ENGINE_RESULT "
MODES = {"atom": {}, "vllm": {"ATOM_DISABLE_VLLM_PLUGIN": "1"}}


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
    env = {
        **os.environ,
        **MODES[mode],
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    if mode == "atom":
        env.pop("ATOM_DISABLE_VLLM_PLUGIN", None)
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


def write_checkpoint(folder: Path, arch: str, shape: dict, dtype: str, init_std=None) -> Path:
    import torch
    import transformers

    if (folder / "config.json").exists():
        return folder
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen3": transformers.Qwen3Config}
    cfg = config_cls["Qwen3" if arch.startswith("Qwen3") else arch](**shape)
    torch_dtype = getattr(torch, dtype)
    cfg.dtype = torch_dtype
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    if init_std:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, init_std)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def prompts(lengths, seed, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- equality


TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


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
        model = write_checkpoint(work / f"tiny-{arch}", arch, TINY, "float32", 0.1)
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


# ---------------------------------------------------------------- throughput

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000,
    tie_word_embeddings=True,
)


def throughput(work: Path, workloads, summary: dict) -> None:
    model = write_checkpoint(work / "qwen3-0.6b-rand", "Qwen3ForCausalLM", QWEN3_06B, "bfloat16")
    rounds = []
    for n, isl, osl in workloads:
        ps = prompts([isl] * n, n + isl, 150000)
        rounds.append({"name": f"warm-{n}x{isl}", "prompts": ps[: min(n, 8)], "max_tokens": 8})
        rounds.append({"name": f"{n}x{isl}->{osl}", "prompts": ps, "max_tokens": osl})
    engine_kw = dict(
        skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.85
    )
    job = {"model": str(model), "engine": engine_kw, "rounds": rounds}
    res = {}
    for mode in ("vllm", "atom"):
        res[mode] = engine(job, mode, work, "tput")
    summary["throughput"] = {
        m: {k: v for k, v in r.items() if k != "rounds"} for m, r in res.items()
    }
    for n, isl, osl in workloads:
        name = f"{n}x{isl}->{osl}"
        rates = {}
        for mode, r in res.items():
            if r.get("failed"):
                continue
            gen = sum(len(o["token_ids"]) for o in r["rounds"][name])
            rates[mode] = gen / r["round_s"][name]
            print(
                f"RESULT throughput {mode} {name} out_tok_s={rates[mode]:.1f} "
                f"init_s={r['init_s']:.1f} cudagraph_mode={r['cudagraph_mode']}",
                flush=True,
            )
        if len(rates) == 2:
            print(f"RESULT throughput ratio atom/vllm {name} = {rates['atom'] / rates['vllm']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["equality", "throughput", "engine"])
    parser.add_argument("job", nargs="?")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--work", default="/tmp/atom-vllm-bench")
    parser.add_argument("--workloads", default="1x128x256,256x512x256")
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
        if args.what == "equality":
            ok = equality(work, summary)
        else:
            workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
            throughput(work, workloads, summary)
    finally:
        (out_dir / f"vllm_plugin_{args.what}.json").write_text(json.dumps(summary))
        with tarfile.open(out_dir / f"vllm_plugin_{args.what}_logs.tar.gz", "w:gz") as tar:
            for log in sorted(work.glob("*.log")):
                tar.add(log, arcname=log.name)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
