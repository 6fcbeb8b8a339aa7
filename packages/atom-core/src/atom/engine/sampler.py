"""Turns last-token logits into next tokens, one row per sequence, per its SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output_ids).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (-inf elsewhere)."""
    logits = logits / params.temperature
    if params.top_k:
        k = min(params.top_k, logits.shape[-1])
        threshold = logits.topk(k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        remove = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(remove, float("-inf")))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_generator = torch.Generator().manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        prompt_ids: list[int],
        output_ids: list[int],
        generator: torch.Generator | None = None,
        block_token_ids: list[int] = (),
    ) -> SampleResult:
        """Samples one token from a [vocab] fp32 logits row."""
        logits = apply_penalties(logits.clone(), params, prompt_ids, output_ids)
        if block_token_ids:
            logits[list(block_token_ids)] = float("-inf")
        logprobs = logits.log_softmax(-1)
        if params.greedy:
            token = int(logits.argmax())
        else:
            probs = filter_logits(logits, params).softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=generator or self.default_generator))
        top = None
        if params.logprobs is not None:
            top = {token: float(logprobs[token])}
            if params.logprobs:
                values, ids = logprobs.topk(params.logprobs)
                top.update(zip(ids.tolist(), values.tolist()))
        return SampleResult(token, float(logprobs[token]), top)
