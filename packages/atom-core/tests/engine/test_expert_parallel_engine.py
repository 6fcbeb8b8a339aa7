"""`LLM(enable_expert_parallel=True, tensor_parallel_size=2)` on CPU (gloo): each rank holds
half of the experts, whole, and the greedy tokens equal HF transformers' in fp32."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.layers.moe import FusedMoE
from atom.testing import references
from tests.models.harness import make_prompts, write_with_random_vectors
from tests.models.test_deepseek import CASES as DEEPSEEK_CASES
from tests.models.test_moe_models import CASES as MOE_CASES

CASES = {
    "qwen3-moe": MOE_CASES["qwen3-moe-top2-norm"],
    "deepseek-v2-mla": DEEPSEEK_CASES["v2-group-limited-qlora-dense1"],
}


@pytest.mark.usefixtures("hf_v2_group_limited_greedy")
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_engine_greedy_matches_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    prompts = make_prompts(256, [4, 19, 7], seed=7)
    expected = references.hf_greedy(folder, prompts, max_tokens=8)
    llm = LLM(
        str(folder),
        dtype="float32",
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    try:
        layers = [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]
        assert layers and all(m.w13_weight.shape[0] == m.num_experts // 2 for m in layers)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.engine.shutdown()
