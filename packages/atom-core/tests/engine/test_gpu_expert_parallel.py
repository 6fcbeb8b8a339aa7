"""Expert parallelism on 2 GPUs (NCCL, Triton kernels): the greedy tokens of HF
transformers in fp32, eager and with CUDA graphs. One command on the lent 2-GPU machine:
`pytest -m gpu tests/engine/test_gpu_expert_parallel.py`."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_gpu_engine import check_greedy_on_gpu
from tests.models.harness import write_with_random_vectors
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES
from tests.models.test_glm4_moe import CASES as GLM_CASES
from tests.models.test_gpt_oss import CASES as GPT_OSS_CASES
from tests.models.test_moe_models import CASES as MOE_CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

CASES = {
    "qwen3-moe": MOE_CASES["qwen3-moe-top2-norm"],
    "mixtral": MOE_CASES["mixtral-top2"],
    "deepseek-v2-mla": DEEPSEEK_CASES["v2-group-limited-qlora-dense1"],
    "deepseek-v3-mla": DEEPSEEK_CASES["v3-grouped-qlora-dense1"],
    "glm-4.5": GLM_CASES["glm-4.5-dense1"],
    "gpt-oss": GPT_OSS_CASES["sliding-full"],
}


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_expert_parallel_greedy_matches_hf(tmp_path, name, enforce_eager):
    check_greedy_on_gpu(
        write_with_random_vectors(CASES[name], tmp_path),
        enforce_eager,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
