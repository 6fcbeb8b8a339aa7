"""Speculative steps replaying real CUDA graphs (Triton kernels, fp32) give the target's
greedy output token for token, and the same drafts as the eager speculative engine:
the verify step (k + 1 tokens per sequence) and the drafter's steps, in batches padded
to a captured size, through chunked prefill, prefix hits and preemption. A few queries
per sequence (verify steps, multi-row catch-ups) take the decode kernels
(atom.kernels.few_queries), which read every key from the pages, as the rows padded in
front of a ragged step need: the prefill kernel's dense K/V would give MHA targets other
tokens on the GPU, where the CPU's torch reference reads pages only. Hybrid targets
(Qwen3-Next) capture their verify step with the DeltaNet state checkpoints in it: the
random drafter's drafts are all but always rejected, so nearly every verify step rolls
back from what its replay kept."""

from __future__ import annotations

import pytest

from atom import LLM
from tests.speculative.test_speculative_graph_inputs import CASES, SMALL_POOL, K, checkpoint
from tests.speculative.workload import run

pytestmark = pytest.mark.gpu

ONE_ROW_DRAFTS = [(0, 1), (1, 1), (2, 1)]
ALL_DRAFTS = sorted([*ONE_ROW_DRAFTS, (0, 2), (0, 3), (0, 4)])
HYBRID_CASES = [("qwen3-next", "repeat"), ("qwen3-next", "random")]


@pytest.mark.parametrize(("case", "kind"), [*CASES, *HYBRID_CASES])
def test_gpu_speculative_graphs_keep_the_targets_output(tmp_path, case, kind):
    folder, spec = checkpoint(case, kind, tmp_path)
    common = dict(model=folder, dtype="float32", skip_tokenizer_init=True, device="cuda")
    expected = run(LLM(**common, enforce_eager=True, num_blocks=64))
    eager = LLM(**common, enforce_eager=True, speculative_config=spec, max_num_seqs=8, **SMALL_POOL)
    assert run(eager) == expected and run(eager) == expected
    llm = LLM(**common, speculative_config=spec, max_num_seqs=8, **SMALL_POOL)
    runner = llm.engine.executor.runner
    assert sorted(runner.target_graphs) == [1, K + 1]
    assert sorted(runner.draft_graphs) == ALL_DRAFTS
    assert all(graphs.capture for graphs in runner.target_graphs.values())
    assert run(llm) == expected
    assert run(llm) == expected  # from the prefix cache (hybrid: none)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks
    assert llm.engine.spec_stats == eager.engine.spec_stats
    # Where every draft is kept ("repeat"), no step may be left without drafts for the
    # decode graph: the verify graph is the one each case must replay.
    assert runner.target_graphs[K + 1].replays > 0
    assert runner.draft_graphs[1, 1].replays > 0 and runner.draft_graphs[2, 1].replays > 0
    if case != "qwen3-next":  # a hybrid's state slots take no padding rows
        assert runner.padded_target_steps > 0
