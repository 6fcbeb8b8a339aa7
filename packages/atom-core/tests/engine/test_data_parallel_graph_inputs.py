"""Data-parallel decode steps through the decode graphs' static buffers on CPU (gloo;
StepGraphs' capture=False, each "replay" run eagerly on the padded buffers): every rank
replays one shared size, its own sequences then padding, an idle rank padding only, and
the greedy tokens equal the single-process engine's. Steps in which a rank prefills run
eagerly on both ranks (atom.engine.data_parallel_graphs)."""

from __future__ import annotations

import dataclasses

import atom.engine.llm as llm_module
from atom import LLM, SamplingParams
from atom.engine.cuda_graphs import StepGraphs
from atom.engine.data_parallel_graphs import shared_decode_size
from atom.engine.llm_engine import LLMEngine
from atom.engine.rank_sampling import RankStep
from atom.engine.step_arrays import StepInput
from tests.engine.test_data_parallel_engine import CASES, DATA_PARALLEL, ENGINE
from tests.models.harness import make_prompts, write_with_random_vectors

PROMPTS = make_prompts(256, [5, 11, 3, 8, 14, 6, 9], seed=9)
# 3 seats per rank (graphs of 1, 2 and 3 sequences) for 7 prompts: the last is admitted
# mid-run. Rank 1 soon runs fewer sequences than rank 0 and pads while its first sequence
# (on KV page 0, where a padding row writing to slot 0 would land) still runs; then it
# idles while rank 0 decodes on.
MAX_TOKENS = [10, 9, 12, 2, 8, 1, 4]


def engine_with_static_graph_inputs(config, *args) -> LLMEngine:
    """LLM's engine with the engine-level switch on: it reaches the workers in the config."""
    return LLMEngine(dataclasses.replace(config, static_graph_inputs=True), *args)


def rank_step(*query_lens: int) -> RankStep:
    return RankStep([StepInput([0] * n, 4, [[0]]) for n in query_lens], [], [], [])


def test_every_rank_decides_on_one_size_from_the_step_list():
    graphs = StepGraphs(None, 1, 8, max_blocks=4, block_size=4, device="cpu", capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    assert shared_decode_size([rank_step(1, 1, 1), rank_step()], graphs) == 4
    assert shared_decode_size([rank_step(1), rank_step(1, 1)], graphs) == 2
    assert shared_decode_size([rank_step(1, 1), rank_step(1, 3)], graphs) is None  # a prefill
    assert shared_decode_size([rank_step(*[1] * 9), rank_step(1)], graphs) is None  # too many
    assert shared_decode_size([rank_step(), rank_step()], graphs) is None
    assert shared_decode_size([rank_step(1), rank_step(1)], None) is None  # no graphs


def test_data_parallel_decode_replays_one_graph_size_on_every_rank(tmp_path, monkeypatch):
    folder = write_with_random_vectors(CASES["deepseek-v3-mla"], tmp_path)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    single = LLM(str(folder), **ENGINE, num_blocks=64)
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, params, use_tqdm=False)]

    monkeypatch.setattr(llm_module, "LLMEngine", engine_with_static_graph_inputs)
    llm = LLM(str(folder), **ENGINE, **DATA_PARALLEL, num_blocks=64, max_num_seqs=3)
    engine = llm.engine
    graphs = engine.executor.runner.decode_graphs
    assert graphs is not None and not graphs.capture and graphs.sizes == [1, 2, 3]
    seqs_per_step = []  # (sequences of each rank) of every pure-decode step
    run_step = engine.executor.step_data_parallel

    def recording(steps):
        if all(len(item.token_ids) == 1 for step in steps for item in step.inputs):
            seqs_per_step.append(tuple(len(step.inputs) for step in steps))
        return run_step(steps)

    monkeypatch.setattr(engine.executor, "step_data_parallel", recording)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        # Every pure-decode step went through the graphs' buffers (rank 1's forwards had
        # to match rank 0's collectives), among them steps with uneven ranks and with an
        # idle one.
        assert graphs.replays == len(seqs_per_step) > 0
        assert any(0 < min(counts) < max(counts) for counts in seqs_per_step)
        assert any(min(counts) == 0 for counts in seqs_per_step)
    finally:
        engine.shutdown()
