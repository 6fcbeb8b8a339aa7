"""Speculative decoding at tensor_parallel_size=2 on CPU (gloo): the drafter's forwards and
a hybrid model's state rollback run on both ranks, and the greedy output is the
target's without speculation, token for token."""

from __future__ import annotations

import pytest

from atom import LLM
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from tests.speculative.workload import run


@pytest.mark.parametrize("family", ["qwen3-next", "glm-4.5"])
def test_greedy_output_is_the_targets(tmp_path, family):
    folder = write_mtp_checkpoint(family, tmp_path, "repeat")
    expected = run(LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True))
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(
        model=str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        speculative_config=spec,
    )
    try:
        assert run(llm) == expected
        stats = llm.engine.spec_stats
        # Steps that keep some drafts (Qwen3-Next rolls its states back) and all of them.
        assert stats.acceptance_rate > 0.1 and stats.accepted_per_position[-1] > 0, stats
    finally:
        llm.engine.shutdown()
