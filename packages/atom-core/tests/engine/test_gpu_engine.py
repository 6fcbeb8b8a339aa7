"""The engine on a CUDA device (Triton kernels) gives HF's greedy tokens for tiny fp32 models."""

from __future__ import annotations

import pytest

from atom.kernels.policy import selected_backend
from tests.models.harness import check_greedy_generation, write_checkpoint
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES
from tests.models.test_llama import CASES as DENSE_CASES
from tests.models.test_moe_models import CASES as MOE_CASES

CASES = {**DENSE_CASES, **MOE_CASES, **DEEPSEEK_CASES}

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize(
    "name",
    ["llama-gqa2", "qwen3-gqa2-tied", "qwen3-sliding-window", "qwen3-moe-top2-norm", "mixtral-top2"]
    + ["v2-greedy-no-qlora", "v3-grouped-qlora-dense1"],
)
def test_gpu_greedy_matches_hf(tmp_path, name, enforce_eager):
    assert selected_backend("paged_attention", "cuda") == "triton"
    folder = write_checkpoint(CASES[name], tmp_path, init_std=0.1)
    check_greedy_generation(
        folder,
        prompt_lengths=[3, 11, 26, 70, 5, 9],
        max_new_tokens=16,
        device="cuda",
        enforce_eager=enforce_eager,
        max_num_seqs=8,
    )
