"""SGLang with atom-sglang vs SGLang alone on a GPU: greedy equality with CUDA graphs.

    export PYTHONPATH=/tmp/sgsite:packages/atom-core/src   # SGLang staged (shared/GPU.md)
    python benchmarks/sglang_plugin.py equality [--out DIR] [--arch NAME ...]   # default: all

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

The reference is HF transformers' greedy tokens on the GPU (fp32) for every architecture
SGLang runs ATOM's models for: SGLang's own models take no fp32 on a GPU (sgl_kernel's
RMSNorm rejects it), so only Llama and Qwen3 also start SGLang's own model, which then
reports a failure rather than tokens; the other architectures skip that start.

No pip on the GPU machine: the atom packages are source folders on PYTHONPATH, and the
plugin's `sglang.srt.plugins` entry point comes from the shim `atom bench` uses
(`atom.bench.engines.engine_env`).
"""

from __future__ import annotations

import time
from pathlib import Path

from plugin_equality import (
    ARCHITECTURES,
    hf_rounds,
    main,
    print_differences,
    rounds,
    run_in_subprocess,
    selected,
    tiny_model,
    token_ids,
)

from atom.bench.engines import ENGINES, engine_env
from atom.registry import all_models

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "packages" / "atom-core" / "src", ROOT / "packages" / "atom-sglang" / "src"]
MODES = {  # Engine keywords and the engine's plugin setting (atom.bench.engines)
    "atom": ({"attention_backend": "atom"}, ENGINES["sglang-atom"]),
    "sglang": ({"attention_backend": "triton"}, ENGINES["sglang"]),
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


def engine(job: dict, mode: str, work: Path, name: str) -> dict:
    engine_kw, spec = MODES[mode]
    env = engine_env(spec, {}, work)
    env["PYTHONPATH"] = ":".join([*map(str, SOURCES), env["PYTHONPATH"]])
    job = {**job, "engine": {**job["engine"], **engine_kw}}
    result, log = run_in_subprocess(__file__, job, env, work, name, mode)
    if not result.get("failed"):
        result["atom_model"] = "built for SGLang" in log
        result["atom_backend_ran"] = "ATOM attention backend: first attention call" in log
        result["cuda_graph_captured"] = "CUDA graph end" in log  # SGLang's capture log line
    return result


# ---------------------------------------------------------------- equality


# ---------------------------------------------------------------- equality


def equality(work: Path, summary: dict, only: list[str] | None) -> bool:
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
    archs = [e.architecture for e in all_models() if "sglang" in e.hosts]
    for i, arch in selected(archs, only):
        model = tiny_model(work, arch)
        job = {"model": str(model), "engine": engine_kw, "rounds": rounds(i)}
        modes = MODES if arch in ARCHITECTURES else ["atom"]
        res = {m: engine(job, m, work, f"eq-{arch}") for m in modes}
        hf = hf_rounds(model, job["rounds"])
        summary[f"equality-{arch}"] = {**res, "hf": hf}
        if res["atom"].get("failed"):
            ok = False
            continue
        # SGLang's own fp32 model has no GPU kernels (sgl_kernel's rmsnorm rejects float32):
        # on GPU the reference is HF; SGLang's own tokens are compared where it runs.
        tokens = {m: token_ids(r["rounds"]) for m, r in res.items() if not r.get("failed")}
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
        print_differences("hf", tokens["atom"], hf)
    return ok


if __name__ == "__main__":
    main("sglang_plugin", run_engine, equality, "/tmp/atom-sglang-bench")
