"""vllm.LLM with the plugin on ATOM's hybrid models (Gated DeltaNet + attention layers):
the DeltaNet states live in vLLM's own hybrid KV-cache manager (one mamba block per
request) and ATOM's kernels read them through ATOM's metadata; greedy tokens equal HF
transformers'.

One engine per checkpoint, with the equality engines' settings (fp32, chunked prefill
with a 48-token budget, so the long prompts are prefilled in chunks beside other
requests' decodes, prefix caching asked for, which the plugin turns off for these).
"""

from __future__ import annotations

import os

import pytest
from vllm_harness import ENGINE, Job, assert_passes_the_check, result_of, rounds, run_jobs

from atom.layers.gated_delta_net import config_state_shapes
from atom.testing import hf_greedy
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

HYBRIDS = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
SERVED = set(served_architectures())


TP2 = (os.cpu_count() or 1) >= 2


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    atom = {**ENGINE, "model_impl": "atom"}
    jobs = [
        Job(f"{arch}-atom", checkpoints(arch), atom, rounds(20 + i), check=True)
        for i, arch in enumerate(HYBRIDS)
        if arch in SERVED
    ]
    if TP2 and HYBRIDS[0] in SERVED:
        # Each rank holds one of the two key heads (and its value heads): half the states.
        tp2 = {**atom, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank
        model = checkpoints(HYBRIDS[0])
        jobs.append(Job(f"{HYBRIDS[0]}-atom-tp2", model, tp2, rounds(20), env, check=True))
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-hybrid"))


def needs(arch: str) -> None:
    if arch not in SERVED:
        pytest.skip(f"{arch} is not marked for vLLM in atom.registry")


@pytest.mark.parametrize("arch", HYBRIDS)
def test_greedy_tokens_equal_hf(runs, checkpoints, arch):
    needs(arch)
    result = result_of(runs, f"{arch}-atom")
    for spec in rounds(20 + HYBRIDS.index(arch)):
        got = [r["token_ids"] for r in result.rounds[spec["name"]]]
        assert got == hf_greedy(checkpoints(arch), spec["prompts"], 8), spec["name"]
    assert_passes_the_check(result, checkpoints(arch))


@pytest.mark.parametrize("arch", HYBRIDS)
def test_deltanet_states_live_in_vllm_mamba_cache(runs, checkpoints, arch):
    needs(arch)
    from transformers import AutoConfig

    result = result_of(runs, f"{arch}-atom")
    (probe,) = result.probe
    config = AutoConfig.from_pretrained(checkpoints(arch))
    linear = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    states = [x for x in probe["attention"] if x["layer_class"] == "VllmStateLayer"]
    assert [x["layer"] for x in states] == [f"model.layers.{i}.linear_attn" for i in linear]
    import torch

    want = [[list(s), str(d)] for s, d in config_state_shapes(config, 1, torch.float32)]
    for layer in states:
        assert layer["backend"] == "atom_vllm.backend.AtomStateBackend"
        assert layer["calls"] > 0
        # [num_blocks, *ATOM's per-slot shape] views of vLLM's mamba pages
        assert [[shape[1:], dtype] for shape, dtype in layer["states"]] == want
    attention = [x for x in probe["attention"] if x["layer_class"] == "Attention"]
    assert len(attention) == len(config.layer_types) - len(linear)
    assert {x["backend_name"] for x in attention} == {"CUSTOM"}
    assert all(x["calls"] > 0 for x in attention)
    # Prefix caching was asked for and turned off, with one line (atom_vllm.patches, 3).
    assert result.log.count("prefix caching off") == 1, result.log[-3000:]
    assert all(r["num_cached_tokens"] == 0 for r in result.rounds["prefix_reuse"])


def test_tensor_parallel_states_are_sharded_and_tokens_equal_hf(runs, checkpoints):
    arch = HYBRIDS[0]
    needs(arch)
    if not TP2:
        pytest.skip("needs two cores")
    import torch
    from transformers import AutoConfig

    result = result_of(runs, f"{arch}-atom-tp2")
    for spec in rounds(20):
        got = [r["token_ids"] for r in result.rounds[spec["name"]]]
        assert got == hf_greedy(checkpoints(arch), spec["prompts"], 8), spec["name"]
    assert_passes_the_check(result, checkpoints(arch))
    config = AutoConfig.from_pretrained(checkpoints(arch))
    want = [[list(s), str(d)] for s, d in config_state_shapes(config, 2, torch.float32)]
    assert len(result.probe) == 2
    for rank in result.probe:
        states = [x for x in rank["attention"] if x["layer_class"] == "VllmStateLayer"]
        assert states and all(x["calls"] > 0 for x in states)
        assert all([[s[1:], d] for s, d in x["states"]] == want for x in states)
