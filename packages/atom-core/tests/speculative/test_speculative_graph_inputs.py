"""The CUDA-graph input path of speculative steps on the CPU: the verify step (k + 1
tokens per sequence) and the drafter's steps run through the static, padded buffers of
their capture sets, each "replay" running the step eagerly (capture_cuda_graphs with
capture=False). Greedy output must stay the target's own, token for token, through
chunked prefill, prefix hits, preemption and batches padded to a capture size, and the
drafts the same as without the buffers (a drafter's error costs only acceptance, so the
acceptance counts must match the eager speculative run's exactly), ragged catch-ups of the
drafter and verify steps with fewer drafts padded to a uniform step among them: both
hold only if the buffers carry every step's tokens, positions, pages and hidden states
right, and, on a hybrid target, the state checkpoints its verify step keeps for the
rollback."""

from __future__ import annotations

import logging

import pytest

from atom import LLM
from atom.engine import llm as llm_module
from atom.engine.state_cache import state_bytes_per_slot
from atom.testing.eagle3_checkpoints import write_drafter, write_target
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from tests.engine.test_data_parallel_graph_inputs import engine_with_static_graph_inputs
from tests.speculative.workload import run

K = 3
# Bounds the verify step at 16 // (K + 1) = 4 sequences: 3 running pad to 4.
SMALL_POOL = dict(max_num_batched_tokens=16, num_blocks=18, block_size=4)


def checkpoint(case: str, kind: str, tmp_path) -> tuple[str, dict]:
    """(target folder, speculative_config) of a tiny MTP family or an EAGLE-3 target."""
    if case in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        target = write_target(case, tmp_path / "target", lean=1.0)
        drafter = write_drafter(target, tmp_path / "drafter", kind)
        return str(target), {"method": "eagle3", "num_speculative_tokens": K, "model": str(drafter)}
    folder = write_mtp_checkpoint(case, tmp_path, kind)
    return str(folder), {"method": "mtp", "num_speculative_tokens": K}


CASES = [
    ("deepseek-v3", "repeat"),  # MLA: the verify step takes the absorbed decode path
    ("glm-4.5", "repeat"),
    ("LlamaForCausalLM", "repeat"),
    ("Qwen3ForCausalLM", "random"),
]


@pytest.mark.parametrize(("case", "kind"), CASES)
def test_static_buffers_of_speculative_steps_keep_the_targets_output(tmp_path, case, kind):
    folder, spec = checkpoint(case, kind, tmp_path)
    common = dict(model=folder, dtype="float32", skip_tokenizer_init=True)
    expected = run(LLM(**common))
    eager = LLM(**common, speculative_config=spec, **SMALL_POOL)
    assert run(eager) == expected and run(eager) == expected
    llm = LLM(**common, speculative_config=spec, **SMALL_POOL)
    runner = llm.engine.executor.runner
    runner.capture_cuda_graphs(8, llm.engine.config.model.max_model_len, 16, K, capture=False)
    assert sorted(runner.target_graphs) == [1, K + 1]
    assert runner.target_graphs[K + 1].sizes == [1, 2, 4]
    assert sorted(runner.draft_graphs) == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (2, 1)]
    assert run(llm) == expected
    assert run(llm) == expected  # from the prefix cache
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks
    # Every kind of step went through the static buffers.
    assert runner.target_graphs[K + 1].replays > 0
    assert runner.draft_graphs[1, 1].replays > 0 and runner.draft_graphs[2, 1].replays > 0
    assert sum(runner.draft_graphs[0, rows].replays for rows in range(1, K + 2)) > 0
    assert llm.engine.spec_stats == eager.engine.spec_stats
    if kind == "repeat":  # steps that keep some drafts and steps that keep them all
        spec_stats = llm.engine.spec_stats
        assert spec_stats.acceptance_rate > 0.1 and spec_stats.accepted_per_position[-1] > 0
        # so some catch-ups were ragged, and replayed padded to the longest
        assert runner.padded_draft_steps > 0
    # Sequences near their max_tokens verify fewer drafts: such steps replay padded too.
    assert runner.padded_target_steps > 0


# Drafts of the random drafter are all but always rejected; the repeating one's are kept
# in part or in full.
HYBRID_CASES = [("qwen3-next", "random"), ("qwen3-next", "repeat"), ("qwen3.5-moe", "random")]


@pytest.mark.parametrize(("case", "kind"), HYBRID_CASES)
def test_a_hybrid_verify_step_rolls_back_from_the_static_buffers(tmp_path, case, kind, caplog):
    """Qwen3-Next, Qwen3.5: the verify step goes through the static buffers too, its
    DeltaNet layers keeping every padded sequence's states in static records; a step that
    rejects drafts rolls back from those, and the output stays the target's only if it
    does so right."""
    folder, spec = checkpoint(case, kind, tmp_path)
    common = dict(model=folder, dtype="float32", skip_tokenizer_init=True)
    expected = run(LLM(**common))
    eager = LLM(**common, speculative_config=spec, **SMALL_POOL)
    assert run(eager) == expected
    llm = LLM(**common, speculative_config=spec, **SMALL_POOL)
    runner = llm.engine.executor.runner
    with caplog.at_level(logging.WARNING, logger="atom.engine.model_runner"):
        runner.capture_cuda_graphs(8, llm.engine.config.model.max_model_len, 16, K, capture=False)
    assert not caplog.records  # no step stays eager
    assert sorted(runner.target_graphs) == [1, K + 1]
    verify = runner.target_graphs[K + 1]
    assert run(llm) == expected
    assert verify.replays > 0 and runner.draft_graphs[1, 1].replays > 0
    # One record per DeltaNet layer, overwritten by every step, not one per step.
    deltanet = [m for m in llm.engine.executor.model.modules() if hasattr(m, "remix")]
    assert list(verify.state_checkpoints.records) == deltanet
    stats = llm.engine.spec_stats
    assert stats == eager.engine.spec_stats
    assert stats.acceptance_rate < (0.1 if kind == "random" else 0.9), stats


def test_a_hybrid_verify_steps_checkpoints_come_out_of_the_kv_budget(tmp_path, monkeypatch):
    """The captured verify step's state records live as long as the graphs: the KV budget
    leaves a state slot for each sequence of the largest verify batch."""
    folder, spec = checkpoint("qwen3-next", "random", tmp_path)
    budget = 4 << 20
    common = dict(
        model=folder, dtype="float32", skip_tokenizer_init=True, speculative_config=spec,
        kv_cache_memory_bytes=budget, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
    )  # fmt: skip
    eager = LLM(**common).engine.executor
    monkeypatch.setattr(llm_module, "LLMEngine", engine_with_static_graph_inputs)
    llm = LLM(**common)
    executor = llm.engine.executor
    verify_batch = 16 // (K + 1)
    slot_bytes = state_bytes_per_slot(executor.model)
    (pool,) = executor.kv_layout.pools
    freed = (eager.num_blocks - executor.num_blocks) * pool.page_bytes
    assert abs(freed - slot_bytes * verify_batch) < pool.page_bytes  # whole pages
    run(llm)
    records = executor.runner.target_graphs[K + 1].state_checkpoints.records.values()
    kept = sum(r.conv.nbytes + r.recurrent.nbytes for r in records)
    assert kept == slot_bytes * verify_batch
