"""Verification draws each emitted token from the target's distribution, whatever the
draft: an empirical check over many draws that fails for a biased verifier."""

from __future__ import annotations

import pytest
import torch

from atom import SamplingParams
from atom.engine.sampler import Sampler
from atom.engine.sequence import Sequence
from atom.speculative.drafts import Drafts
from atom.speculative.verifier import verify

VOCAB, DRAWS, TOP_K, TEMPERATURE = 8, 20_000, 6, 0.8


def target_distribution(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) over the top-k tokens, written out by hand."""
    kept = logits.topk(TOP_K).indices
    probs = torch.zeros(VOCAB)
    probs[kept] = (logits[kept] / TEMPERATURE).softmax(-1)
    return probs


def on_device(drafts: list[list[int]]) -> Drafts:
    """The drafts as the proposer leaves them: one tensor, and where each one is."""
    starts = torch.tensor([0, *map(len, drafts)]).cumsum(0).tolist()
    tokens = torch.tensor([t for d in drafts for t in d])
    return Drafts(tokens, [list(range(start, start + len(d))) for start, d in zip(starts, drafts)])


def emitted_tokens(draft: list[int], forced_acceptance: float | None = None) -> list[list[int]]:
    rows = torch.randn(len(draft) + 1, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=4)
    seqs = [Sequence([1], params) for _ in range(DRAWS)]
    logits = rows.repeat(DRAWS, 1)
    results = verify(
        logits, seqs, on_device([draft] * DRAWS), Sampler(seed=7), forced_acceptance
    ).results()
    return rows, [[r.token_id for r in emitted] for emitted in results]


def bound(num_draws: int) -> float:
    """About four times the expected total variation of num_draws exact draws."""
    return 1.25 * (VOCAB / num_draws) ** 0.5


def total_variation(tokens: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float()
    return 0.5 * (counts / counts.sum() - expected).abs().sum().item()


@pytest.mark.parametrize("draft", [[2, 5], [0, 0]])
def test_each_emitted_token_follows_the_target(draft):
    rows, emitted = emitted_tokens(draft)
    first = [tokens[0] for tokens in emitted]
    assert total_variation(first, target_distribution(rows[0])) < bound(len(first))
    # Given the first draft accepted, the next token follows the second row's distribution.
    second = [tokens[1] for tokens in emitted if tokens[0] == draft[0]]
    assert len(second) > 1000
    assert total_variation(second, target_distribution(rows[1])) < bound(len(second))
    # A rejected draft is never what replaces it.
    assert all(
        tokens[-1] != draft[len(tokens) - 1] for tokens in emitted if len(tokens) <= len(draft)
    )


def test_a_verifier_that_favours_drafts_fails_the_check():
    rows, emitted = emitted_tokens([2, 5], forced_acceptance=0.9)
    first = [tokens[0] for tokens in emitted]
    assert total_variation(first, target_distribution(rows[0])) > 0.2


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    rows = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    best = rows.argmax(-1).tolist()
    wrong = (best[1] + 1) % VOCAB
    greedy = SamplingParams(temperature=0, max_tokens=8)
    seqs = [Sequence([1], greedy) for _ in range(2)]
    drafts = [[best[0], wrong, best[2]], [best[0], best[1], best[2]]]
    results = verify(torch.cat([rows, rows]), seqs, on_device(drafts), Sampler()).results()
    assert [r.token_id for r in results[0]] == [best[0], best[1]]
    assert [r.token_id for r in results[1]] == best
    logprobs = rows.log_softmax(-1)
    assert results[1][3].logprob == pytest.approx(logprobs[3, best[3]].item(), rel=1e-6)
