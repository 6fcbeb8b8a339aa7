"""SGLang's CPU engine (0.5.21, 0.5.23) with atom-sglang on ATOM's hybrid models (Gated DeltaNet +
attention layers): the DeltaNet states live in SGLang's own mamba pool (one row per
request, `HybridReqToTokenPool`), ATOM's kernels read them through ATOM's metadata, and
greedy tokens equal HF transformers' for a mixed-length batch and for requests sharing
a prefix (chunked prefill: 64 tokens).

SGLang keeps the conv state in bfloat16 unless SGLANG_MAMBA_CONV_DTYPE says otherwise;
ATOM's ops keep it in the model dtype (fp32 here), so the engines set it. SGLang's default
mamba radix-cache strategy for these models ("extra_buffer") needs a GPU (FLA kernels,
arg_groups/mamba_hook.py: "extra_buffer needs CUDA/..."); its CPU engine runs them with
"no_buffer".
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from sglang_harness import (
    ENGINE,
    MAX_TOKENS,
    Run,
    assert_passes_the_check,
    result_of,
    rounds,
    run_jobs,
)

from atom.testing import hf_greedy
from atom_sglang import served_architectures

pytestmark = pytest.mark.slow

HYBRIDS = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
ATOM = {
    **ENGINE,
    "attention_backend": "atom",
    "mamba_radix_cache_strategy": "no_buffer",
    "disable_overlap_schedule": True,
}
FP32_CONV_STATE = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
SERVED = set(served_architectures())


def seed_of(arch: str) -> int:
    return 40 + HYBRIDS.index(arch)


def with_interval(checkpoint: Path, root: Path) -> Path:
    """A copy of `checkpoint` whose config.json also gives `full_attention_interval` (the
    interval its `layer_types` follow)."""
    out = root / checkpoint.name
    shutil.copytree(checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    kinds = config["layer_types"]
    interval = kinds.index("full_attention") + 1
    assert kinds == [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(len(kinds))
    ]
    config["full_attention_interval"] = interval
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def models(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-checkpoints")
    return {arch: with_interval(checkpoints(arch), root) for arch in HYBRIDS}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    job = [
        Run(f"{arch}-atom", models[arch], ATOM, rounds(seed_of(arch)), FP32_CONV_STATE, True)
        for arch in HYBRIDS
        if arch in SERVED
    ]
    return run_jobs([job], tmp_path_factory.mktemp("sglang-hybrid"))


@pytest.mark.parametrize("arch", HYBRIDS)
def test_greedy_tokens_equal_hf(runs, models, arch):
    if arch not in SERVED:
        pytest.skip(f"{arch} is not marked for SGLang in atom.registry")
    result = result_of(runs, f"{arch}-atom")
    for spec in rounds(seed_of(arch)):
        want = hf_greedy(models[arch], spec["prompts"], MAX_TOKENS)
        assert result.tokens()[spec["name"]] == want, spec["name"]
    assert_passes_the_check(result, models[arch])


@pytest.mark.parametrize("arch", HYBRIDS)
def test_deltanet_states_live_in_sglang_mamba_pool(runs, models, arch):
    if arch not in SERVED:
        pytest.skip(f"{arch} is not marked for SGLang in atom.registry")
    result = result_of(runs, f"{arch}-atom")
    config = json.loads((models[arch] / "config.json").read_text())
    linear = [i for i, kind in enumerate(config["layer_types"]) if kind == "linear_attention"]
    assert "Mamba Cache is allocated" in result.log
    used = re.findall(
        r"ATOM Gated DeltaNet model\.layers\.(\d+)\.linear_attn: states in SGLang", result.log
    )
    assert sorted(map(int, used)) == linear
    # SGLang's mamba radix cache served part of a prompt, restoring the state it had
    # cached into the request's row: the tokens above still equal HF's.
    assert any(r["cached_tokens"] > 0 for r in result.rounds["prefix_reuse"])
