"""SGLang with atom-sglang vs SGLang alone on a GPU: greedy equality with CUDA graphs.

    export PYTHONPATH=/tmp/sgsite:packages/atom-core/src   # SGLang staged (shared/GPU.md)
    python benchmarks/sglang_plugin.py equality [--out DIR]   # tiny fp32 Llama/Qwen3

Throughput is `atom bench --engines sglang,sglang-atom --sglang-path /tmp/sgsite`.

Checkpoints, job files and engine logs go to --work (default /tmp/atom-sglang-bench);
--out gets one JSON summary and a tar.gz of the logs. Lines starting with RESULT carry
the figures.

Each engine runs in its own process (`engine` subcommand), same checkpoint, same prompts
(random token ids, ignore_eos, greedy), `sampling_backend="pytorch"`, CUDA graphs on:
* "atom": the plugin on, ATOM's model, `attention_backend="atom"` (ATOM's Triton kernels,
  the kernel policy's choice on CUDA);
* "sglang": `ATOM_DISABLE_SGLANG_PLUGIN=1`, SGLang's own model, `attention_backend="triton"`.
Both capture decode steps in CUDA graphs; prefill graphs are off on both sides (ATOM's
backend implements SGLang's decode-graph hooks, not its breakable prefill graphs).
equality also compares with HF transformers' greedy tokens on the GPU (fp32).

No pip on the GPU machine: the atom packages are source folders on PYTHONPATH, and the
plugin's `sglang.srt.plugins` entry point is made visible by writing a minimal
`atom_sglang-<version>.dist-info` (METADATA + entry_points.txt, read from atom-sglang's
pyproject.toml) into a folder that is put on the engines' PYTHONPATH.
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
import tomllib
from pathlib import Path

from atom.testing import tiny_config, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "packages" / "atom-core" / "src", ROOT / "packages" / "atom-sglang" / "src"]
RESULT = "ENGINE_RESULT "
MODES = {
    "atom": ({"attention_backend": "atom"}, {}),
    "sglang": ({"attention_backend": "triton"}, {"ATOM_DISABLE_SGLANG_PLUGIN": "1"}),
}


# ---------------------------------------------------------------- one engine (subprocess)


def run_engine(job: dict) -> dict:
    import sglang

    started = time.perf_counter()
    llm = sglang.Engine(model_path=job["model"], **job["engine"])
    out = {"init_s": time.perf_counter() - started, "rounds": {}, "round_s": {}}
    try:
        for spec in job["rounds"]:
            params = {"temperature": 0.0, "max_new_tokens": spec["max_tokens"], "ignore_eos": True}
            t = time.perf_counter()
            outputs = llm.generate(input_ids=spec["prompts"], sampling_params=params)
            out["round_s"][spec["name"]] = time.perf_counter() - t
            out["rounds"][spec["name"]] = [
                {"token_ids": o["output_ids"], "cached_tokens": o["meta_info"]["cached_tokens"]}
                for o in outputs
            ]
    finally:
        llm.shutdown()
    return out


def plugin_site(work: Path) -> Path:
    """A folder holding atom-sglang's dist-info, so importlib.metadata finds its entry point."""
    project = tomllib.loads((ROOT / "packages/atom-sglang/pyproject.toml").read_text())["project"]
    info = work / "plugin-site" / f"atom_sglang-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = ["[sglang.srt.plugins]"]
    lines += [f"{k} = {v}" for k, v in project["entry-points"]["sglang.srt.plugins"].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info.parent


def engine(job: dict, mode: str, work: Path, name: str) -> dict:
    engine_kw, mode_env = MODES[mode]
    env = {k: v for k, v in os.environ.items() if k != "ATOM_DISABLE_SGLANG_PLUGIN"}
    paths = [plugin_site(work), *SOURCES, *filter(None, env.get("PYTHONPATH", "").split(":"))]
    env.update(mode_env, PYTHONPATH=":".join(map(str, paths)))
    job = {**job, "engine": {**job["engine"], **engine_kw}}
    job_file = work / f"{name}.{mode}.json"
    job_file.write_text(json.dumps(job))
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "engine", str(job_file)], env=env, capture_output=True, text=True
    )
    log = proc.stdout + proc.stderr
    (work / f"{name}.{mode}.log").write_text(log)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode or not lines:
        print(f"RESULT {name} {mode} FAILED rc={proc.returncode}\n{log[-4000:]}", flush=True)
        return {"failed": True}
    result = json.loads(lines[-1][len(RESULT) :])
    result["wall_s"] = time.perf_counter() - t
    result["atom_model"] = "built for SGLang" in log
    result["atom_backend_ran"] = "ATOM attention backend: first attention call" in log
    result["cuda_graph_captured"] = "CUDA graph end" in log  # SGLang's capture log line
    return result


# ---------------------------------------------------------------- checkpoints


def prompts(lengths, seed, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir: Path, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.cuda().eval()
    outputs = []
    with torch.inference_mode():
        for prompt in batch:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = hf(input_ids=torch.tensor([ids], device="cuda")).logits
                ids.append(int(logits[0, -1].argmax()))
            outputs.append(ids[len(prompt) :])
    del hf
    torch.cuda.empty_cache()
    return outputs


# ---------------------------------------------------------------- equality


def equality(work: Path, summary: dict) -> bool:
    engine_kw = dict(
        dtype="float32",
        skip_tokenizer_init=True,
        sampling_backend="pytorch",
        disable_prefill_cuda_graph=True,
        mem_fraction_static=0.3,
        context_length=512,
        chunked_prefill_size=64,
        cuda_graph_max_bs_decode=16,
        random_seed=0,
        log_level="info",
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
        hf = {r["name"]: hf_greedy(model, r["prompts"], 16) for r in rounds}
        summary[f"equality-{arch}"] = {**res, "hf": hf}
        if res["atom"].get("failed"):
            ok = False
            continue
        # SGLang's own fp32 model has no GPU kernels (sgl_kernel's rmsnorm rejects float32):
        # on GPU the reference is HF; SGLang's own tokens are compared where it runs.
        tokens = {
            m: {n: [o["token_ids"] for o in v] for n, v in r["rounds"].items()}
            for m, r in res.items()
            if not r.get("failed")
        }
        same_sglang = tokens["atom"] == tokens["sglang"] if "sglang" in tokens else "n/a"
        same_hf = tokens["atom"] == hf
        ran = res["atom"]["atom_model"] and res["atom"]["atom_backend_ran"]
        ok &= same_sglang is not False and same_hf and ran
        cached = [o["cached_tokens"] for o in res["atom"]["rounds"]["prefix_reuse"]]
        print(
            f"RESULT equality {arch} atom_vs_sglang={same_sglang} atom_vs_hf={same_hf} "
            f"atom_model_and_backend_ran={ran} "
            f"cuda_graphs={res['atom']['cuda_graph_captured']} cached={cached}",
            flush=True,
        )
        for name in hf:
            for j, (a, h) in enumerate(zip(tokens["atom"][name], hf[name])):
                if a != h:
                    print(f"  {name}[{j}] atom={a} hf={h}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["equality", "engine"])
    parser.add_argument("job", nargs="?")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--work", default="/tmp/atom-sglang-bench")
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
        (out_dir / f"sglang_plugin_{args.what}.json").write_text(json.dumps(summary))
        with tarfile.open(out_dir / f"sglang_plugin_{args.what}_logs.tar.gz", "w:gz") as tar:
            for log in sorted(work.glob("*.log")):
                tar.add(log, arcname=log.name)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
