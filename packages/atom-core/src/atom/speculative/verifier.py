"""Verifies drafts against the target's logits so that the output follows the target.

A sequence with k drafts d1..dk has k + 1 rows of target logits; row j gives the
distribution p_j of the token after d1..dj. Drafts are deterministic (the drafter's
argmax), so speculative sampling reduces to: accept d_{j+1} with probability
p_j(d_{j+1}); at the first rejection emit a draw from p_j with d_{j+1} removed
(renormalised); when every draft is accepted, emit a draw from p_k. Each emitted token
then has exactly the target's distribution. Greedy rows accept a draft where it is the
argmax and emit the argmax where it is not: the output is token for token the target's.

With `forced_acceptance` r (benchmarks), each draft is accepted with probability r and
the first rejected row emits the target's own token instead.
"""

from __future__ import annotations

import torch

from atom.engine.sampler import (
    HostCopy,
    Sampler,
    SampleResult,
    filter_columns,
    filter_scaled,
    topk_columns,
    unpack_entry,
)
from atom.engine.sequence import Sequence
from atom.speculative.drafts import Drafts


def verify(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: Drafts,
    sampler: Sampler,
    forced_acceptance: float | None = None,
) -> PendingVerification:
    """logits: fp32 [sum(num drafts + 1), vocab], each sequence's rows in turn."""
    device = logits.device
    counts = drafts.counts
    row_seqs = [seq for seq, n in zip(seqs, counts) for _ in range(n + 1)]
    # Row j of a sequence is followed by its draft j + 1; its last row by none (-1).
    draft = torch.full((len(row_seqs),), -1, dtype=torch.long, device=device)
    rows, start = [], 0
    for n in counts:
        rows += range(start, start + n)
        start += n + 1
    drafts.feed(rows).apply(draft)
    has_draft = draft >= 0
    safe_draft = draft.clamp_min(0)[:, None]

    fallback = logits.argmax(-1)
    accept = has_draft & (fallback == draft)
    random_rows = [i for i, seq in enumerate(row_seqs) if not seq.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows).to(device, non_blocking=True)
        rows = [row_seqs[i] for i in random_rows]
        probs = filter_scaled(
            logits[index], *filter_columns([s.params for s in rows], logits)
        ).softmax(-1)
        u = sampler.uniform_for(rows, device)
        draft_probability = probs.gather(1, safe_draft[index])
        rejected_out = (
            probs
            if forced_acceptance is not None
            else probs.scatter(
                1, safe_draft[index], torch.where(has_draft[index, None], 0.0, draft_probability)
            )
        )
        noise = sampler.noise_for(rows, probs)
        fallback = fallback.index_put((index,), (rejected_out / noise).argmax(-1))
        accept_probability = draft_probability.squeeze(1)
        accept = accept.index_put((index,), has_draft[index] & (u < accept_probability))
    if forced_acceptance is not None:
        u = sampler.uniform_for(row_seqs, device)
        accept = has_draft & (u < forced_acceptance)

    emitted = torch.where(accept, draft, fallback)
    # The whole log_softmax only where top logprobs are asked: a verify step has k + 1
    # rows of the vocabulary per sequence.
    k = max((s.params.logprobs or 0 for s in seqs), default=0)
    normaliser = logits.logsumexp(-1, keepdim=True)
    packed = torch.cat(
        [
            emitted[:, None].double(),
            (logits.gather(1, emitted[:, None]) - normaliser).double(),
            accept[:, None].double(),
            *(topk_columns(logits - normaliser, k) if k else []),
        ],
        1,
    )
    return PendingVerification(packed, seqs, counts, k)


class PendingVerification:
    def __init__(self, packed: torch.Tensor, seqs: list[Sequence], num_drafts: list[int], k: int):
        self.copy = HostCopy(packed)
        self.seqs, self.num_drafts, self.k = seqs, num_drafts, k

    def results(self) -> list[list[SampleResult]]:
        """Each sequence's emitted tokens: its accepted drafts, then one token of the target."""
        rows = self.copy.rows()
        results, start = [], 0
        for seq, n in zip(self.seqs, self.num_drafts):
            own = rows[start : start + n + 1]
            start += n + 1
            accepted = next((j for j, row in enumerate(own[:n]) if not row[2]), n)
            wanted = seq.params.logprobs
            results.append(
                [
                    SampleResult(
                        int(row[0]),
                        row[1],
                        unpack_entry([row[0], row[1], *row[3:]], wanted, self.k)
                        if wanted is not None
                        else None,
                    )
                    for row in own[: accepted + 1]
                ]
            )
        return results
