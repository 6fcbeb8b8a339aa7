"""Per-request logit_bias and guide masks: the sampler against a torch reference, and the
engine mixing requests with and without them."""

from __future__ import annotations

import pytest
import torch

from atom import LLM, SamplingParams
from atom.engine.sampler import Sampler
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParamsError
from tests.models.harness import make_prompts, write_checkpoint
from tests.models.test_llama import llama_config

VOCAB = 256


class AllowedSet:
    """A guide that allows a fixed set of tokens forever."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.accepted: list[int] = []

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.tokens] = True
        return mask

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    @property
    def is_done(self) -> bool:
        return False


class Script:
    """A guide that allows exactly the next token of a script, and is done after it."""

    def __init__(self, script: list[int]):
        self.script = script
        self.position = 0

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.script[self.position]] = True
        return mask

    def accept(self, token_id: int) -> None:
        assert token_id == self.script[self.position]
        self.position += 1

    @property
    def is_done(self) -> bool:
        return self.position == len(self.script)


def sample(logits: torch.Tensor, params: list[SamplingParams]):
    seqs = [Sequence([1, 2, 3], p) for p in params]
    return Sampler().sample(logits.clone(), seqs), seqs


def test_logit_bias_matches_a_torch_reference():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    target = int(logits[0].argmin())
    top = int(logits[1].argmax())
    biases = [{target: 100.0}, {top: -100.0, 7: 0.5}, {}]
    params = [SamplingParams(temperature=0, logprobs=2, logit_bias=b) for b in biases]
    results, _ = sample(logits, params)
    reference = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            reference[row, token] += value
    assert results[0].token_id == target
    assert results[1].token_id != top
    expected = reference.log_softmax(-1)
    for row, result in enumerate(results):
        token = int(reference[row].argmax())
        assert result.token_id == token
        assert result.logprob == pytest.approx(float(expected[row, token]), abs=1e-5)
        top2 = expected[row].topk(2)
        assert set(result.top_logprobs) == {token, *top2.indices.tolist()}


def test_guide_mask_restricts_choices_exactly():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = [5, 77, 200]
    greedy = SamplingParams(temperature=0, guide_factory=lambda: AllowedSet(allowed))
    results, seqs = sample(logits, [greedy, SamplingParams(temperature=0)])
    reference = torch.full((VOCAB,), float("-inf"))
    reference[allowed] = logits[0, allowed]
    assert results[0].token_id == int(reference.argmax())
    assert results[1].token_id == int(logits[1].argmax())
    drawn = set()
    for seed in range(40):
        params = SamplingParams(
            temperature=1.5, seed=seed, guide_factory=lambda: AllowedSet(allowed)
        )
        drawn.add(sample(logits[:1], [params])[0][0].token_id)
    assert drawn <= set(allowed)
    assert len(drawn) > 1  # sampling, not a fixed pick


def test_unprocessed_rows_get_the_tokens_they_get_alone():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    plain = [SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=0)]
    alone = [sample(logits[i : i + 1], [p])[0][0].token_id for i, p in zip((0, 2), plain)]
    mixed = [
        plain[0],
        SamplingParams(temperature=0.9, seed=12, logit_bias={3: 50.0}),
        plain[1],
        SamplingParams(temperature=0, guide_factory=lambda: AllowedSet([9])),
    ]
    results, _ = sample(logits, mixed)
    assert [results[0].token_id, results[2].token_id] == alone
    assert results[3].token_id == 9


def test_logit_bias_errors_name_the_field():
    for bad in ({-1: 1.0}, {"5": 1.0}, {5: float("nan")}, {5: "high"}):
        with pytest.raises(SamplingParamsError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(SamplingParamsError, match="^guide_factory"):
        SamplingParams(guide_factory="json")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = write_checkpoint(llama_config(), tmp_path_factory.mktemp("llama"), init_std=0.1)
    return LLM(model=str(folder), dtype="float32", skip_tokenizer_init=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_engine_mixes_processed_and_plain_requests(llm, overlap):
    llm.engine.async_scheduling = overlap
    prompts = make_prompts(VOCAB, [6, 11, 4, 9], seed=4)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    script = [17, 4, 250, 4, 99]
    params = [
        plain,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0}),
        SamplingParams(temperature=0, max_tokens=8, guide_factory=lambda: Script(script)),
        plain,
    ]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], plain, use_tqdm=False)[0] for p in (prompts[0], prompts[3])]
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[3].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == [42] * 8
    guided = mixed[2].outputs[0]
    assert (guided.token_ids, guided.finish_reason) == (script, "stop")


def test_engine_refuses_a_bias_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)
