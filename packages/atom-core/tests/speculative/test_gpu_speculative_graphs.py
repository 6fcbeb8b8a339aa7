"""Speculative steps replaying real CUDA graphs (Triton kernels, fp32) give the target's
greedy output token for token, and the same drafts as the eager speculative engine:
the verify step (k + 1 tokens per sequence) and the drafter's steps, in batches padded
to a captured size, through chunked prefill, prefix hits and preemption. MLA targets
keep their verify step and multi-row catch-ups eager (the up-projected prefill path reads
page counts on the host). Hybrid targets (Qwen3-Next) capture their verify step with the
DeltaNet state checkpoints in it: the random drafter's drafts are all but always rejected,
so nearly every verify step rolls back from what its replay kept."""

from __future__ import annotations

import pytest

from atom import LLM
from tests.speculative.test_speculative_graph_inputs import CASES, SMALL_POOL, K, checkpoint
from tests.speculative.workload import run

pytestmark = pytest.mark.gpu

ONE_ROW_DRAFTS = [(0, 1), (1, 1), (2, 1)]
ALL_DRAFTS = sorted([*ONE_ROW_DRAFTS, (0, 2), (0, 3), (0, 4)])
# What each case captures: target query lengths, drafter (step, rows per sequence).
CAPTURED = {"deepseek-v3": ([1], ONE_ROW_DRAFTS)}
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
    targets, drafts = CAPTURED.get(case, ([1, K + 1], ALL_DRAFTS))
    assert sorted(runner.target_graphs) == targets
    assert sorted(runner.draft_graphs) == drafts
    assert all(graphs.capture for graphs in runner.target_graphs.values())
    assert run(llm) == expected
    assert run(llm) == expected  # from the prefix cache (hybrid: none)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks
    assert llm.engine.spec_stats == eager.engine.spec_stats
    assert all(runner.target_graphs[q].replays > 0 for q in targets)
    assert runner.draft_graphs[1, 1].replays > 0 and runner.draft_graphs[2, 1].replays > 0
