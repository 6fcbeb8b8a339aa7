"""Sampler features against HF's logits processors and HF logits."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from atom import LLM, SamplingParams
from atom.engine.sampler import Sampler, apply_penalties, filter_logits
from atom.engine.sequence import Sequence
from tests.models.harness import hf_logits, load_hf, make_prompts, write_checkpoint
from tests.models.test_llama import llama_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(llama_config(), tmp_path_factory.mktemp("llama"), init_std=0.1)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=str(checkpoint), dtype="float32", skip_tokenizer_init=True)


PROMPT = make_prompts(256, [9], seed=5)[0]


def first_tokens(outputs):
    return [c.token_ids for c in outputs[0].outputs]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    a = first_tokens(llm.generate([PROMPT], params, use_tqdm=False))
    b = first_tokens(llm.generate([PROMPT], params, use_tqdm=False))
    c = first_tokens(
        llm.generate(
            [PROMPT],
            SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
    )
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(llm):
    greedy = first_tokens(
        llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    )
    top1 = first_tokens(
        llm.generate(
            [PROMPT],
            SamplingParams(temperature=0.8, top_k=1, seed=1, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
    )
    assert top1 == greedy


def test_n_completions(llm):
    out = llm.generate(
        [PROMPT],
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_token_ids(llm):
    greedy = first_tokens(
        llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    )[0]
    stop = greedy[3]
    cut = greedy.index(stop)
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == greedy[: cut + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_logprobs_match_hf(llm, checkpoint):
    params = SamplingParams(
        temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    expected = hf_logits(load_hf(checkpoint), PROMPT + completion.token_ids).log_softmax(-1)
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = expected[len(PROMPT) - 1 + step]
        top = row.topk(3)
        assert set(entry) == {token, *top.indices.tolist()}
        for tid, value in entry.items():
            assert value == pytest.approx(row[tid].item(), abs=1e-4)
    assert out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = expected[position - 1]
        assert entry[PROMPT[position]] == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
        assert len(entry) in (2, 3)


def test_min_tokens_blocks_eos(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, min_tokens=6), use_tqdm=False
    )[0]
    assert eos not in out.outputs[0].token_ids[:6] and len(out.outputs[0].token_ids) == 6


def test_repetition_penalty_matches_hf():
    logits = torch.randn(50)
    seen = [1, 5, 5, 9, 30]
    params = SamplingParams(repetition_penalty=1.7)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), logits[None].clone())[0]
    ours = apply_penalties(logits[None].clone(), [params], [seen[:2]], [seen[2:]])[0]
    torch.testing.assert_close(ours, expected)


def test_presence_and_frequency_penalties():
    logits = torch.randn(20)
    output = [3, 3, 3, 7]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    expected = logits.clone()
    for token in set(output):
        expected[token] -= 0.5 + 0.25 * output.count(token)
    ours = apply_penalties(logits[None].clone(), [params], [[]], [output])[0]
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize(
    "params, warper",
    [
        (SamplingParams(temperature=1.0, top_k=5), TopKLogitsWarper(5)),
        (SamplingParams(temperature=1.0, top_p=0.7), TopPLogitsWarper(0.7)),
        (SamplingParams(temperature=1.0, min_p=0.1), MinPLogitsWarper(0.1)),
    ],
)
def test_filters_match_hf_warpers(params, warper):
    torch.manual_seed(0)
    logits = torch.randn(64) * 3
    ours = filter_logits(logits[None], [params])[0]
    theirs = warper(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()])


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, min_p=0.2, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.05, seed=11),
]


def test_batched_penalties_and_filters_equal_row_by_row():
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED), 64) * 3
    prompts = [[1, 2, 3], [4], [5, 5, 6], [7, 8], []]
    outputs = [[2, 9], [], [6, 6, 10], [8, 8, 8, 11], [3]]
    batched = apply_penalties(logits.clone(), MIXED, prompts, outputs)
    for i, p in enumerate(MIXED):
        row = apply_penalties(logits[i : i + 1].clone(), [p], [prompts[i]], [outputs[i]])
        torch.testing.assert_close(batched[i : i + 1], row)
    sampled = [i for i, p in enumerate(MIXED) if not p.greedy]
    filtered = filter_logits(batched[sampled], [MIXED[i] for i in sampled])
    for row, i in enumerate(sampled):
        alone = filter_logits(batched[i : i + 1], [MIXED[i]])[0]
        assert torch.equal(filtered[row].isinf(), alone.isinf())
        torch.testing.assert_close(filtered[row], alone)


def _sequences(params):
    return [Sequence(list(range(1, 6)), p) for p in params]


def test_sampler_batch_rows_are_independent():
    """Greedy rows are the argmax, filtered tokens are never drawn, and a seeded row draws
    the same token whatever else shares its batch."""
    torch.manual_seed(2)
    logits = torch.randn(len(MIXED), 64) * 3
    results = Sampler().sample(logits.clone(), _sequences(MIXED))
    assert results[0].token_id == int(logits[0].argmax())
    allowed = logits[1].topk(5).indices.tolist()
    assert results[1].token_id in allowed
    for i in (0, 1, 4):  # rows without penalties: the logprob of the raw logits
        expected = logits[i].log_softmax(-1)[results[i].token_id].item()
        assert results[i].logprob == pytest.approx(expected, abs=1e-5)
    alone = Sampler(seed=99).sample(logits[4:].clone(), _sequences(MIXED[4:]))
    assert alone[0].token_id == results[4].token_id


def test_sampler_blocks_tokens_and_reports_top_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)]
    results = Sampler().sample(logits.clone(), _sequences(params), blocked=[[1], ()])
    assert [r.token_id for r in results] == [3, 0]
    expected = logits[0].masked_fill(torch.arange(4) == 1, float("-inf")).log_softmax(-1)
    assert results[0].top_logprobs == pytest.approx({3: expected[3].item(), 2: expected[2].item()})
    assert results[1].top_logprobs is None
