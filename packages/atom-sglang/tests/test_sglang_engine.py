"""SGLang's CPU engine (0.5.21, 0.5.23) with atom-sglang, end to end, on tiny random fp32 checkpoints.

One engine per configuration, each serving every check of that configuration (a start
costs 20-45 s here); all engines run in one module fixture, in two processes (plugin on /
off) that start their engines one after another. For every SGLang-capable
ATOM architecture: SGLang + ATOM (registry override, `attention_backend="atom"`) gives
the same greedy tokens as HF transformers and as SGLang's own implementation (DeepSeek,
MiniMax-M2 and GPT-OSS: HF only, see HF_ONLY), for a
mixed-length batch and for requests reusing a cached prefix (chunked prefill: 64
tokens; GPT-OSS on SGLang's hybrid SWA pool, see HYBRID_SWA). Also: the
external-model-package route, the "atom" backend under SGLang's own
Qwen3, `ATOM_DISABLE_SGLANG_PLUGIN=1`, an architecture ATOM does not serve, and MLP
sizes that SGLang's CPU loader pads (a Qwen3-MoE with moe_intermediate_size 48, a Qwen3
with intermediate_size 200): SGLang + ATOM equals HF transformers there too.
"""

from __future__ import annotations

import re

import pytest
from sglang_harness import (
    ENGINE,
    MAX_TOKENS,
    PREFIX_LEN,
    Run,
    assert_passes_the_check,
    result_of,
    rounds,
    run_jobs,
)

from atom.registry import get_entry
from atom.testing import hf_greedy, tiny_config, write_checkpoint
from atom_sglang import served_architectures

pytestmark = pytest.mark.slow

ARCHS = [
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
    "GptOssForCausalLM",
]
ATOM = {**ENGINE, "attention_backend": "atom"}
STOCK = {**ENGINE, "attention_backend": "torch_native"}
PLUGIN_OFF = {"ATOM_DISABLE_SGLANG_PLUGIN": "1"}
# SGLang's own implementation of each architecture, the reference of the equality tests.
# Qwen3's runs on ATOM's backend (so that job also covers "atom" under SGLang's models).
REFERENCE = {
    "LlamaForCausalLM": (STOCK, PLUGIN_OFF),
    "Qwen3ForCausalLM": (ATOM, {"ATOM_SGLANG_BACKEND_ONLY": "1"}),
    "Qwen3MoeForCausalLM": (STOCK, PLUGIN_OFF),
    "Glm4MoeForCausalLM": (STOCK, PLUGIN_OFF),
}
# SGLang's own DeepSeek and MiniMax-M2 do not run on its CPU engine with these
# checkpoints (the reasons still in 0.5.21's and 0.5.23's source), so ATOM's are compared
# with HF only:
HF_ONLY = {
    # get_rope_cpu() asserts rope scaling: its CPU rotary path only has DeepSeek-YaRN.
    "DeepseekV2ForCausalLM": "SGLang's CPU rope requires rope_scaling",
    # SGLang's model reads config.moe_layer_freq, which transformers 5.12's
    # DeepseekV3Config does not define (AttributeError while building the layers).
    "DeepseekV3ForCausalLM": "DeepseekV3Config has no moe_layer_freq",
    # Without sgl_kernel's AMX ops, its QK-norm over all heads runs a Triton kernel that
    # asserts CUDA tensors (rms_sumsq_serial).
    "MiniMaxM2ForCausalLM": "its CPU QK-norm needs sgl_kernel's AMX ops",
    # SGLang takes GPT-OSS only on backends with sinks and sliding windows; on the CPU
    # engine that is intel_amx, which this CPU (no AMX) replaces with torch_native (it
    # has neither). Its model also reads config.swiglu_limit, which transformers 5.12's
    # GptOssConfig does not define (5.19's, SGLang 0.5.23's pin, does) (AttributeError while building the layers).
    "GptOssForCausalLM": "SGLang's CPU GPT-OSS needs AMX and config.swiglu_limit",
}
# Sliding-window and full layers: SGLang serves them from its hybrid SWA pool, whose
# radix cache frees the sliding slots of tokens that left the window as it caches a
# request. A later request then reuses a prefix only where the window before its end
# survived, which the prefix rounds' shared prefix (followed by other tokens) never has.
HYBRID_SWA = {"GptOssForCausalLM"}
EXTERNAL = {**PLUGIN_OFF, "SGLANG_EXTERNAL_MODEL_PACKAGE": "atom_sglang.models"}
UNSUPPORTED = "GPT2LMHeadModel"
# MLP sizes that are no multiple of 32 (tp=1): SGLang's CPU loader pads them to 64 / 224
# (`adjust_config_with_unaligned_cpu_tp`), ATOM's model must keep the checkpoint's.
UNALIGNED = {
    "moe48": ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 48}),
    "dense200": ("Qwen3ForCausalLM", {"intermediate_size": 200}),
}


def seed_of(arch: str) -> int:
    if arch in UNALIGNED:
        return 70 + list(UNALIGNED).index(arch)
    return 10 * (ARCHS.index(arch) + 1) if arch in ARCHS else 99


@pytest.fixture(scope="module")
def unaligned(tmp_path_factory):
    root = tmp_path_factory.mktemp("unaligned")
    return {
        name: write_checkpoint(tiny_config(arch, **sizes), root / name, init_std=0.1)
        for name, (arch, sizes) in UNALIGNED.items()
    }


@pytest.fixture(scope="module")
def runs(checkpoints, unaligned, tmp_path_factory):
    def run(name: str, arch: str, engine: dict, env: dict | None = None) -> Run:
        model = unaligned[arch] if arch in UNALIGNED else checkpoints(arch)
        # ATOM's run of each family also reads `atom bench check`'s streams.
        check = name == f"{arch}-atom" and arch in ARCHS
        return Run(name, model, engine, rounds(seed_of(arch)), env or {}, check)

    def reference(arch: str) -> Run:
        engine, env = REFERENCE[arch]
        return run(f"{arch}-sglang", arch, engine, env)

    llama, qwen3, moe, v2, v3, glm, minimax, gpt_oss = ARCHS
    moe48, dense200 = UNALIGNED
    # Two processes (one per core), eight engines each.
    jobs = [
        [run(f"{a}-atom", a, ATOM) for a in (llama, moe, v3, glm, gpt_oss, moe48)]
        + [reference(qwen3), run("external", qwen3, STOCK, EXTERNAL)],
        [run(f"{a}-atom", a, ATOM) for a in (qwen3, v2, minimax, dense200)]
        + [reference(a) for a in (llama, moe, glm)]
        + [run("unsupported", UNSUPPORTED, STOCK)],
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("sglang-jobs"))


def assert_same(got, want, what: str) -> None:
    for name, prompts in want.items():
        assert got[name] == prompts, f"{what}, round {name!r}: {got[name]} != {prompts}"


def hf_reference(checkpoints, arch: str, model=None) -> dict[str, list[list[int]]]:
    model = checkpoints(arch) if model is None else model
    return {s["name"]: hf_greedy(model, s["prompts"], MAX_TOKENS) for s in rounds(seed_of(arch))}


def assert_prefix_cached(result) -> None:
    cached = [r["cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert all(c >= PREFIX_LEN for c in cached), f"prefix not reused: cached_tokens={cached}"


def assert_hybrid_swa_pool_used(result) -> None:
    """SGLang's hybrid SWA pool held the sliding layers (layer 0 of the tiny checkpoints)
    and freed slots of tokens that left the window while ATOM attended: its pool is a
    fifth smaller than the full one, so only freeing lets it fill more slowly."""
    assert "SWAKVPool mem usage" in result.log
    pools = "MHA pool, hybrid SWA (full layers [1], sliding layers [0])"
    assert f"ATOM attention backend: {pools}" in result.log
    usage = re.findall(r"full token usage: ([\d.]+), swa token usage: ([\d.]+)", result.log)
    assert any(float(swa) < float(full) for full, swa in usage), f"no SWA slot freed: {usage}"


@pytest.mark.parametrize("arch", ARCHS)
def test_atom_equals_hf_and_sglang(runs, checkpoints, arch):
    assert arch in served_architectures()
    atom = result_of(runs, f"{arch}-atom")
    assert_same(atom.tokens(), hf_reference(checkpoints, arch), f"SGLang+ATOM {arch} vs HF")
    if arch not in HF_ONLY:
        assert_same(atom.tokens(), result_of(runs, f"{arch}-sglang").tokens(), "ATOM vs SGLang")
    assert_passes_the_check(atom, checkpoints(arch))
    if arch in HYBRID_SWA:
        assert_hybrid_swa_pool_used(atom)
    else:
        assert_prefix_cached(atom)
    # Proof that ATOM's model and ATOM's attention backend served the requests.
    entry = get_entry(arch)
    assert f"ATOM {arch} ({entry.class_path}) built for SGLang: 2 {entry.attention}" in atom.log
    pool = "MLA" if entry.attention == "MLA" else "MHA"
    assert f"ATOM attention backend: {pool} pool" in atom.log
    assert "ATOM attention backend: first attention call" in atom.log


def test_atom_backend_under_sglang_own_model(runs):
    result = result_of(runs, "Qwen3ForCausalLM-sglang")
    assert "ATOM attention backend: first attention call" in result.log
    assert "built for SGLang" not in result.log  # SGLang's own Qwen3
    assert "type=Qwen3ForCausalLM" in result.log
    assert_prefix_cached(result)


@pytest.mark.parametrize("name", list(UNALIGNED))
def test_atom_equals_hf_with_mlp_sizes_sglang_pads(runs, checkpoints, unaligned, name):
    arch, sizes = UNALIGNED[name]
    atom = result_of(runs, f"{name}-atom")
    want = hf_reference(checkpoints, name, unaligned[name])
    assert_same(atom.tokens(), want, f"SGLang+ATOM {arch} {sizes} vs HF")
    assert_prefix_cached(atom)
    assert f"ATOM builds the checkpoint's sizes SGLang padded: {sizes}" in atom.log
    assert f"ATOM {arch} ({get_entry(arch).class_path}) built for SGLang" in atom.log
    assert "ATOM attention backend: first attention call" in atom.log


def test_disable_env_gives_plain_sglang(runs):
    result = result_of(runs, "LlamaForCausalLM-sglang")
    assert "ATOM_DISABLE_SGLANG_PLUGIN=1: ATOM plugin inactive" in result.log
    assert "built for SGLang" not in result.log
    assert "ATOM attention backend" not in result.log


def test_external_model_package_route(runs, checkpoints):
    """SGLANG_EXTERNAL_MODEL_PACKAGE without the plugin: ATOM's model on SGLang's backend."""
    result = result_of(runs, "external")
    assert "ATOM Qwen3ForCausalLM (atom.models.qwen3:Qwen3ForCausalLM) built" in result.log
    assert "ATOM attention backend" not in result.log  # torch_native did the attention
    assert_same(result.tokens(), hf_reference(checkpoints, "Qwen3ForCausalLM"), "external vs HF")
    assert_prefix_cached(result)


def test_unsupported_architecture_runs_sglang_own_class(runs, checkpoints):
    result = result_of(runs, "unsupported")
    assert "ATOM 0.1.0 serves" in result.log  # the plugin was active
    assert "built for SGLang" not in result.log
    assert_same(result.tokens(), hf_reference(checkpoints, UNSUPPORTED), "GPT-2 vs HF")
