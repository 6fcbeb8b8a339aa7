"""The native engine's per-request state cache for hybrid (Gated DeltaNet) models: slots
come back on finish, abort and preemption; chunked prefill carries the state between
chunks; a preempted sequence recomputes from zeros; the pools' bytes come out of the KV
budget; prefix caching is off. Greedy tokens equal HF transformers throughout."""

from __future__ import annotations

import logging

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.model_runner import kv_cache_bytes_per_block
from atom.engine.state_cache import StateSlots, num_state_slots, state_bytes_per_slot
from atom.testing import references, tiny_config
from tests.models.harness import make_prompts, write_with_random_vectors

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ASYNC = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config("Qwen3_5ForCausalLM")  # three DeltaNet layers, then attention
    return write_with_random_vectors(config, tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(512, [5, 31, 12, 40, 2, 20], seed=3)


@pytest.fixture(scope="module")
def hf_greedy(checkpoint, prompts):
    return references.hf_greedy(checkpoint, prompts, GREEDY.max_tokens)


def engine(checkpoint, **kwargs) -> LLM:
    return LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True, **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pools_free(llm: LLM) -> None:
    core = llm.engine
    slots = core.scheduler.state_slots
    assert slots.num_free == slots.num_slots - 1  # every row but the scratch row
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_slot_allocator():
    slots = StateSlots(3)
    taken = [slots.take() for _ in range(3)]
    assert sorted(taken) == [1, 2, 3]  # row 0 is the scratch row
    with pytest.raises(RuntimeError, match="all 3 state slots are taken"):
        slots.take()
    slots.release(taken[1])
    assert slots.take() == taken[1]


@ASYNC
def test_batch_equals_hf(checkpoint, prompts, hf_greedy, overlap):
    llm = engine(checkpoint, async_scheduling=overlap)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    # Slots reused by a second batch start clean.
    assert tokens(llm.generate(prompts[::-1], GREEDY, use_tqdm=False)) == hf_greedy[::-1]
    assert_pools_free(llm)


@ASYNC
@pytest.mark.parametrize("budget", [3, 16])
def test_chunked_prefill_equals_one_shot(checkpoint, prompts, hf_greedy, budget, overlap):
    llm = engine(checkpoint, max_num_batched_tokens=budget, async_scheduling=overlap)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    assert_pools_free(llm)


@ASYNC
def test_preemption_recomputes_from_zeros(checkpoint, prompts, hf_greedy, overlap):
    # 10 blocks of 8 tokens: the longest sequence alone needs 7, so the scheduler must
    # preempt; a preempted sequence gives its slot back and recomputes from a fresh one.
    llm = engine(checkpoint, block_size=8, num_blocks=10, async_scheduling=overlap)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
    assert llm.engine.stats().num_preemptions > 0
    assert_pools_free(llm)


@ASYNC
def test_aborting_fifty_streams_frees_every_slot(checkpoint, prompts, overlap):
    llm = engine(checkpoint, max_num_seqs=8, async_scheduling=overlap)
    core = llm.engine
    ids = [core.add_request(prompts[i % len(prompts)], GREEDY) for i in range(50)]
    for _ in range(3):
        core.step()
    assert core.scheduler.state_slots.num_free == 0  # eight streams hold slots
    for request_id in ids:  # running and waiting ones alike
        core.abort_request(request_id)
    while core.scheduler.has_work() or core._in_flight is not None:
        core.step()
    assert not core.has_unfinished_requests()
    assert_pools_free(llm)
    # The freed slots serve new requests with clean states.
    assert tokens(llm.generate(prompts[:2], GREEDY, use_tqdm=False)) == tokens(
        engine(checkpoint).generate(prompts[:2], GREEDY, use_tqdm=False)
    )


def test_state_bytes_come_out_of_the_kv_budget(checkpoint, caplog):
    budget = 4 << 20
    with caplog.at_level(logging.INFO, logger="atom.engine.llm_engine"):
        llm = engine(checkpoint, kv_cache_memory_bytes=budget, max_num_seqs=32, block_size=16)
    model = llm.engine.model
    state = state_bytes_per_slot(model) * num_state_slots(32)
    per_block = kv_cache_bytes_per_block(model, 16, torch.float32)
    assert llm.engine.executor.state_cache_bytes == state > 0
    assert llm.engine.executor.num_blocks == (budget - state) // per_block
    messages = [r.getMessage() for r in caplog.records]
    assert sum("prefix caching is off" in m for m in messages) == 1
    assert any(m.startswith("state cache: 33 slots") for m in messages)
    assert not llm.engine.block_manager.enable_prefix_caching


def test_decode_graph_inputs_carry_the_state_slots(checkpoint, prompts):
    """The decode-graph input path (static buffers, batches padded to a captured size) on
    the CPU, replayed eagerly: the state slots must reach the layers through the static
    buffers, and padding rows must leave the sequences' rows alone."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 4, 7)]
    outputs = {}
    for staged in (False, True):
        llm = engine(checkpoint, block_size=4)
        runner = llm.engine.executor.runner
        if staged:
            runner.capture_cuda_graphs(8, 64, capture=False)
        outputs[staged] = tokens(llm.generate(prompts[:3], params, use_tqdm=False))
        if staged:
            assert runner.decode_graphs.replays >= 6
    assert outputs[True] == outputs[False]
