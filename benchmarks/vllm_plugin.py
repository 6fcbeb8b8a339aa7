"""vLLM with atom-vllm vs vLLM alone on a GPU: greedy equality with CUDA graphs.

    python benchmarks/vllm_plugin.py equality [--out DIR] [--arch NAME ...]   # default: all

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

The reference is vLLM's own model (plugin off) for Llama, Qwen3, Qwen3-MoE, Mixtral, GLM-4.x
MoE, GPT-OSS, MiniMax-M2, Qwen3-Next and Qwen3.5 (dense and MoE; these hybrids run without
prefix caching on both sides, as atom-vllm runs them).
vLLM's GPU MLA backends take fp16/bf16 only, so its own DeepSeek cannot run in fp32: as on
CPU, DeepSeek-V2/V3 are compared with HF transformers' greedy tokens (fp32, GPU), which
every architecture also reports. Triton dots in fp32 default to tf32; both engines get
TRITON_F32_DEFAULT=ieee so vLLM's Triton MoE computes in fp32 as ATOM's kernels do.
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
from atom.registry import get_entry

MODES = {"atom": ENGINES["vllm-atom"], "vllm": ENGINES["vllm"]}
VLLM_REFERENCE = [
    *ARCHITECTURES,
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
]
HF_REFERENCE = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]


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
    env["TRITON_F32_DEFAULT"] = "ieee"
    return run_in_subprocess(__file__, job, env, work, name, mode)[0]


# ---------------------------------------------------------------- equality


def equality(work: Path, summary: dict, only: list[str] | None) -> bool:
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
    for i, arch in selected(VLLM_REFERENCE + HF_REFERENCE, only):
        model = tiny_model(work, arch)
        # atom-vllm runs hybrid models without prefix caching (its patch 3); vLLM's own
        # then runs without it too, so both report the same (zero) cache hits.
        kw = engine_kw | {"enable_prefix_caching": False} if get_entry(arch).hybrid else engine_kw
        job = {"model": str(model), "engine": kw, "rounds": rounds(i)}
        modes = MODES if arch in VLLM_REFERENCE else ["atom"]
        res = {m: engine(job, m, work, f"eq-{arch}") for m in modes}
        hf = hf_rounds(model, job["rounds"])
        summary[f"equality-{arch}"] = {**res, "hf": hf}
        if any(r.get("failed") for r in res.values()):
            ok = False
            continue
        tokens = {m: token_ids(r["rounds"]) for m, r in res.items()}
        if "vllm" in res:  # tokens and prefix-cache hits, round by round
            reference_name, reference = "vllm", tokens["vllm"]
            same = res["atom"]["rounds"] == res["vllm"]["rounds"]
        else:
            reference_name, reference = "hf", hf
            same = tokens["atom"] == hf
        probe = res["atom"]["probe"]
        backends = sorted({x["backend_name"] for w in probe for x in w["attention"]})
        calls = sum(x["calls"] or 0 for w in probe for x in w["attention"])
        ok &= same and calls > 0
        fields = {f"atom_vs_{reference_name}": same}
        if reference_name != "hf":
            fields["atom_vs_hf"] = tokens["atom"] == hf
        fields |= {
            "atom_model": probe[0]["atom_class"],
            "backends": backends,
            "atom_impl_calls": calls,
            "cudagraph_mode": res["atom"]["cudagraph_mode"],
            "cached": [r["num_cached_tokens"] for r in res["atom"]["rounds"]["prefix_reuse"]],
        }
        print(f"RESULT equality {arch} " + " ".join(f"{k}={v}" for k, v in fields.items()))
        print_differences(reference_name, tokens["atom"], reference)
    return ok


if __name__ == "__main__":
    main("vllm_plugin", run_engine, equality, "/tmp/atom-vllm-bench")
