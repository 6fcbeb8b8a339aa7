"""Tensor parallelism on 2 GPUs (NCCL, the one-shot symmetric-memory all-reduce for small
messages, async scheduling): the greedy tokens of HF transformers in fp32, eager and with
CUDA graphs. One command on the lent 2-GPU machine:
`pytest -m gpu tests/engine/test_gpu_tensor_parallel.py`."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_gpu_engine import CASES, check_greedy_on_gpu
from tests.models.harness import write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize(
    "name", ["llama-gqa2", "qwen3-gqa2-tied", "qwen3-moe-top2-norm", "v2-greedy-no-qlora"]
)
def test_gpu_tensor_parallel_greedy_matches_hf(tmp_path, name, enforce_eager):
    check_greedy_on_gpu(
        write_checkpoint(CASES[name], tmp_path, init_std=0.1),
        enforce_eager,
        tensor_parallel_size=2,
    )
