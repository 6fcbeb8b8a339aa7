"""DeepSeek-V4 with its attention step on the Triton kernels equals the model on the torch
references (atom.layers.compressed_attention_impl): the tiny model's logits over a prefix
step, then a mixed prefill in which one sequence reads that prefix back from the pages and
another shares its pages (a prefix hit), then decode steps, on scattered pages. The
Triton route is capturable and its decode steps on CUDA graphs' static, padded buffers give
the eager tokens; on a GPU, captured graphs do.

On CPU under Triton's interpreter (TRITON_INTERPRET=1, only the V4 attention ops run
there; the rest of the model stays on torch), on a GPU otherwise; skipped without either.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom import LLM, SamplingParams
from atom.config import ModelConfig
from atom.cuda_graphs import graph_blockers
from atom.engine.model_runner import ModelRunner, StepInput, allocate_kv_cache, build_model
from atom.kernels import policy
from atom.layers.compressed_attention_impl import STEP_OPS
from atom.testing import random_prompts
from atom.testing.triton_device import triton_test_device
from tests.models.test_deepseek_v4 import (
    GREEDY,
    hf_generate,
    tokens_through_graph_buffers,
    write_v4,
)

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import compressed_attention, indexer, window_compression  # noqa: E402, F401

ARCHITECTURE = "DeepseekV4ForCausalLM"
BLOCK_SIZE, NUM_BLOCKS = 4, 96
SHARED_PAGES = 7  # the prefix hit: 28 tokens, 7 CSA entries and one HCA entry


@pytest.fixture
def route():
    """route(backend) makes the V4 attention ops run `backend`'s implementation on this
    device (the torch one where a CPU would pick it)."""
    saved = {op: dict(policy._IMPLS[op]) for op in STEP_OPS}

    def select(backend: str) -> None:
        for op in STEP_OPS:
            policy._IMPLS[op] = {"torch": saved[op][backend]}
        policy._select.cache_clear()
        assert policy.dispatch(op, torch.device(DEVICE)) is saved[op][backend]

    yield select
    policy._IMPLS.update(saved)
    policy._select.cache_clear()


def run_steps(model) -> list[torch.Tensor]:
    """Every step's logits: A's first 30 tokens; then A's other 26 (14 CSA entries, over
    3x the top-k; 3 HCA entries; past the window), B's 5 and C, which shares A's first
    pages and brings 12 tokens of its own; then two decode steps."""
    allocate_kv_cache(model, NUM_BLOCKS, BLOCK_SIZE, torch.float32, DEVICE)
    runner = ModelRunner(model, BLOCK_SIZE, DEVICE)
    pages = list(range(NUM_BLOCKS))
    random.Random(3).shuffle(pages)
    a, b, c = random_prompts([56, 5, 12], seed=4)
    table_a, table_b = pages[:16], pages[16:20]
    table_c = table_a[:SHARED_PAGES] + pages[20:30]
    shared = SHARED_PAGES * BLOCK_SIZE
    logits = [runner.run([StepInput(a[:30], 0, [table_a])], all_positions=True)]
    step = [StepInput(a[30:], 30, [table_a]), StepInput(b, 0, [table_b]),
            StepInput(c, shared, [table_c])]  # fmt: skip
    logits.append(runner.run(step, all_positions=True))
    lengths = [56, 5, shared + 12]
    for token in random_prompts([2], seed=5)[0]:
        step = [StepInput([token], n, [t]) for n, t in zip(lengths, (table_a, table_b, table_c))]
        logits.append(runner.run(step))
        lengths = [n + 1 for n in lengths]
    return logits


def test_triton_route_equals_torch_route(tmp_path, route):
    write_v4(tmp_path)
    model = build_model(ModelConfig.from_pretrained(tmp_path, dtype=torch.float32), DEVICE,
                        progress=False)  # fmt: skip
    route("torch")
    expected = run_steps(model)
    route("triton")
    got = run_steps(model)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=f"step {step}")


# Decode batches of 5 and 3 sequences pad to 8 and 4; the 37-token prompt closes CSA
# windows and an HCA one (position 47) in its decode steps, on entries of 4 pages each.
PROMPTS = random_prompts([37, 3, 20, 9, 30], seed=6)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 3, 11)]
KV_BYTES = 16 << 20


def test_triton_route_is_capturable_and_its_graph_buffers_give_eager_tokens(tmp_path, route):
    """The torch references block CUDA graphs, the Triton route does not; its decode steps
    on the graphs' static, padded buffers (run, not captured) give the eager tokens."""
    folder = write_v4(tmp_path)
    model = build_model(ModelConfig.from_pretrained(folder, dtype=torch.float32), DEVICE,
                        progress=False)  # fmt: skip
    device = torch.device(DEVICE)
    route("torch")
    assert "CompressedAttentionImpl" in graph_blockers(model, device)
    route("triton")
    assert "CompressedAttentionImpl" not in graph_blockers(model, device)
    eager, staged = tokens_through_graph_buffers(
        folder, PROMPTS, PARAMS, DEVICE, kv_cache_memory_bytes=KV_BYTES
    )
    assert staged == eager


def test_triton_route_reads_rows_and_entries_through_their_groups_tables(tmp_path, route):
    """The engine's split layout (rows in window groups of reach 8 and 16, entries in a
    full group, each its own pool: test_deepseek_v4_kv_pools.py) on the Triton kernels:
    HF's greedy tokens through chunked prefill and a prefix hit."""
    folder = write_v4(tmp_path, sliding_window=8)
    shared = random_prompts([28], seed=7)[0]
    prompts = [shared + [5, 6], shared + [9]]
    expected = hf_generate(folder, prompts)
    route("triton")
    # Pools of 18 entry pages and 7 + 9 row pages: the row pools reuse the pages their
    # windows passed while the entry pool still hands out new ones, so a page id means
    # another page in each table (a kernel reading the wrong table reads wrong rows).
    llm = LLM(
        str(folder), dtype="float32", device=DEVICE, skip_tokenizer_init=True, block_size=4,
        max_num_batched_tokens=16, max_model_len=64, kv_cache_memory_bytes=60_000,
    )  # fmt: skip
    assert [pool.num_blocks for pool in llm.engine.kv_layout.pools] == [18, 7, 9]
    got = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == expected
    assert got[1].num_cached_tokens == 28


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_gpu_cuda_graphs_give_eager_tokens(tmp_path):
    """The native engine captures V4's decode steps (every part of the model) and their
    replays, padded batches included, give the eager engine's tokens."""
    folder = write_v4(tmp_path)
    tokens = {}
    for eager in (True, False):
        llm = LLM(
            str(folder), dtype="float32", device="cuda", skip_tokenizer_init=True,
            block_size=4, max_num_seqs=8, kv_cache_memory_bytes=KV_BYTES, enforce_eager=eager,
        )  # fmt: skip
        graphs = llm.engine.executor.runner.decode_graphs
        assert (graphs is None) == eager
        generated = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in generated]
        if not eager:
            assert sorted(graphs.graphs) == [1, 2, 4, 8]
            # Every decode step replayed one (async scheduling may add a step).
            assert graphs.replays >= max(p.max_tokens for p in PARAMS) - 1
    assert tokens[False] == tokens[True]
