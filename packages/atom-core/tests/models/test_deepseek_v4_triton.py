"""DeepSeek-V4 with its attention step on the Triton kernels equals the model on the torch
references (atom.layers.compressed_attention_impl): the tiny model's logits over a prefix
step, then a mixed prefill in which one sequence reads that prefix back from the pages and
another shares its pages (a prefix hit), then decode steps, on scattered pages.

On CPU under Triton's interpreter (TRITON_INTERPRET=1, only the V4 attention ops run
there; the rest of the model stays on torch), on a GPU otherwise; skipped without either.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom.config import ModelConfig
from atom.engine.model_runner import ModelRunner, StepInput, allocate_kv_cache, build_model
from atom.kernels import policy
from atom.layers.compressed_attention_impl import STEP_OPS
from atom.testing import random_prompts, tiny_config
from atom.testing.trained_look import draw_hash_tables
from atom.testing.triton_device import triton_test_device
from tests.models.harness import write_with_random_vectors

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
    write_with_random_vectors(tiny_config(ARCHITECTURE), tmp_path)
    draw_hash_tables(tmp_path, tiny_config(ARCHITECTURE).n_routed_experts)
    model = build_model(ModelConfig.from_pretrained(tmp_path, dtype=torch.float32), DEVICE,
                        progress=False)  # fmt: skip
    route("torch")
    expected = run_steps(model)
    route("triton")
    got = run_steps(model)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=f"step {step}")
