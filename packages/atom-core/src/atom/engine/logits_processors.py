"""Per-request logits processing: `logit_bias` and guided decoding's allowed-token masks.

Applied by the sampler to the rows whose requests ask for them, and only when one does:
a batch without them runs the plain sampler, so the common case pays nothing.
"""

from __future__ import annotations

import torch

from atom.engine.sequence import Sequence

NEG_INF = float("-inf")


def needs_processing(seqs: list[Sequence]) -> bool:
    return any(seq.params.has_logits_processors for seq in seqs)


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Row i of fp32 `logits` [B, vocab], in place: plus seqs[i]'s logit_bias, and -inf
    on every token its guide forbids."""
    _add_logit_bias(logits, seqs)
    _mask_guided_rows(logits, seqs)


def _add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols, biases = [], [], []
    for i, seq in enumerate(seqs):
        for token, bias in (seq.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            biases.append(bias)
    if rows:
        index = torch.tensor([rows, cols]).to(logits.device, non_blocking=True)
        values = torch.tensor(biases, dtype=logits.dtype).to(logits.device, non_blocking=True)
        logits.index_put_((index[0], index[1]), values, accumulate=True)


def _mask_guided_rows(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    guided = [i for i, seq in enumerate(seqs) if seq.guide is not None]
    if not guided:
        return
    vocab = logits.shape[-1]
    allowed = torch.stack([seqs[i].guide.allowed_tokens(vocab) for i in guided])
    allowed = allowed.to(logits.device, non_blocking=True)
    index = torch.tensor(guided).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, NEG_INF)
