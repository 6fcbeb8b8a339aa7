"""compile=True (the sampler through torch.compile) picks the same tokens as eager."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.sampler import Sampler, compiled_pick, pick
from atom.engine.sequence import Sequence
from tests.models.harness import make_prompts, write_checkpoint
from tests.models.test_llama import qwen3_config

SEEDED = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=s, logprobs=2)
    for s in range(5)
]


def _sequences(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence([1, 2, 3], p) for p in params]


def _sample(compile: bool, logits: torch.Tensor, params: list[SamplingParams]):
    """Two steps, so the seeded rows' generators advance as in a real run."""
    sampler, seqs = Sampler(compile=compile), _sequences(params)
    return [sampler.sample(logits[step].clone(), seqs) for step in range(2)]


@pytest.mark.parametrize(
    "params",
    [
        pytest.param([SamplingParams(temperature=0, logprobs=1)] * 7, id="greedy"),
        pytest.param(SEEDED, id="seeded"),
        pytest.param([SamplingParams(temperature=0, logprobs=1), *SEEDED[:3]], id="mixed"),
    ],
)
def test_compiled_sampler_matches_eager(params):
    torch.manual_seed(0)
    logits = torch.randn(2, len(params), 512) * 4
    eager, compiled = _sample(False, logits, params), _sample(True, logits, params)
    for eager_step, compiled_step in zip(eager, compiled):
        assert [r.token_id for r in compiled_step] == [r.token_id for r in eager_step]
        for e, c in zip(eager_step, compiled_step):
            assert c.logprob == pytest.approx(e.logprob, abs=1e-5)
            assert c.top_logprobs.keys() == e.top_logprobs.keys()


def _engine_tokens(folder, compile: bool, prompts, params, **kwargs) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, compile=compile, **kwargs)
    assert llm.engine.sampler.pick is (compiled_pick() if compile else pick)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED_TOP_P = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    "device, num_prompts, mix, kwargs",
    [
        # Greedy only on CPU: the seeded variants' compile time is spent in the tests above.
        pytest.param("cpu", 6, [GREEDY], {}, id="cpu"),
        # Decode CUDA graphs (37 sequences pad to 48) and async scheduling around the
        # compiled sampler, greedy and seeded rows in one batch.
        pytest.param(
            "cuda",
            37,
            [GREEDY, SEEDED_TOP_P],
            {"max_num_seqs": 64},
            id="cuda",
            marks=pytest.mark.gpu,
        ),
    ],
)
def test_engine_tokens_equal_with_compile(tmp_path, device, num_prompts, mix, kwargs):
    checkpoint = write_checkpoint(qwen3_config(), tmp_path, init_std=0.1)
    prompts = make_prompts(256, [3 + (7 * i) % 40 for i in range(num_prompts)], seed=4)
    params = [mix[i % len(mix)] for i in range(len(prompts))]
    eager, compiled = (
        _engine_tokens(checkpoint, compile, prompts, params, device=device, **kwargs)
        for compile in (False, True)
    )
    assert compiled == eager
