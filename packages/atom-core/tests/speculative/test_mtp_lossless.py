"""Speculative decoding with a checkpoint's MTP layer gives, token for token, the
native engine's greedy output without it: through chunked prefill, prefix hits and
preemption, with drafts that are mostly accepted and drafts that are always rejected
(DeepSeek-V3.2 and GLM-5: the MTP layer runs its own sparse-attention indexer). On
Qwen3-Next and Qwen3.5, a verify step that rejects drafts rolls the DeltaNet states back."""

from __future__ import annotations

import logging

import pytest

from atom import LLM, SamplingParams
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from tests.engine.test_engine import assert_equal_up_to_float_rounding
from tests.speculative.workload import prompts, run


def engine(folder, speculative: bool, **kwargs) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": 3} if speculative else None
    return LLM(
        model=str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        speculative_config=spec,
        **kwargs,
    )


# A drafter that is never right costs a step per token: it runs on MLA only.
@pytest.mark.parametrize(
    ("family", "drafter"),
    [
        ("deepseek-v3", "repeat"),
        ("glm-4.5", "repeat"),
        ("deepseek-v3.2", "repeat"),
        ("glm-5", "repeat"),
        ("qwen3-next", "repeat"),
        ("qwen3.5-moe", "repeat"),
        ("deepseek-v3", "random"),
    ],
)
def test_greedy_output_is_the_targets(tmp_path, family, drafter):
    folder = write_mtp_checkpoint(family, tmp_path, drafter)
    expected = run(engine(folder, speculative=False))
    # A small token budget chunks the prompts; few pages force preemptions.
    llm = engine(folder, speculative=True, max_num_batched_tokens=16, num_blocks=18, block_size=4)
    assert run(llm) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks
    spec = llm.engine.spec_stats
    assert spec.num_draft_tokens > 0
    if drafter == "repeat":  # steps that accept some drafts and steps that accept all
        assert spec.acceptance_rate > 0.1 and spec.accepted_per_position[-1] > 0, spec
    else:
        assert spec.acceptance_rate < 0.1, spec
    # A second pass is served from the prefix cache (and the drafter's K/V in its pages);
    # a hybrid model has none.
    assert run(llm) == expected
    assert (llm.engine.stats().prefix_cache_hits > 0) != llm.engine.hybrid


def test_logprobs_penalties_and_seeded_sampling(tmp_path, caplog):
    folder = write_mtp_checkpoint("deepseek-v3", tmp_path, "repeat")
    batch = prompts()[:3]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=16, ignore_eos=True),
    ]

    def outputs(llm: LLM):
        return [
            (c.token_ids, c.logprobs, c.cumulative_logprob)
            for o in llm.generate(batch, params, use_tqdm=False)
            for c in o.outputs
        ]

    expected = outputs(engine(folder, speculative=False))
    with caplog.at_level(logging.INFO, logger="atom.speculative.draft_policy"):
        llm = engine(folder, speculative=True)
        first, again = outputs(llm), outputs(llm)
    # Greedy tokens and their logprobs are the target's; penalised requests run unchanged.
    assert_equal_up_to_float_rounding(first[:2], expected[:2])
    # A seeded request draws the same tokens again.
    assert first[2][0] == again[2][0] and len(first[2][0]) == 16
    skipped = [
        r for r in caplog.records if "requests with penalties decode without drafts" in r.message
    ]
    assert len(skipped) == 1


def test_forced_acceptance_sets_the_rate(tmp_path):
    """For benchmarks: drafts of a drafter that is never right are accepted at the set
    rate, so a step's cost can be measured at a chosen mean accepted length."""
    folder = write_mtp_checkpoint("glm-4.5", tmp_path, "random")
    spec = {"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance": 0.6}
    llm = LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
    llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 100
    # Each draft is accepted with probability 0.6 until the first rejection.
    assert 0.45 < stats.accepted_per_position[0] / stats.num_drafts < 0.75, stats
    expected_length = 1 + 0.6 + 0.6**2 + 0.6**3
    assert abs(stats.mean_accepted_length - expected_length) < 0.3, stats
