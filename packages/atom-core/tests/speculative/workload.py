"""The requests every lossless test runs: prompts sharing a prefix, greedy, with stops."""

from __future__ import annotations

from atom import LLM, SamplingParams
from tests.models.harness import make_prompts


def prompts() -> list[list[int]]:
    # Two prompts share a 20-token prefix so the second run hits the prefix cache.
    base = make_prompts(256, [7, 20, 33, 3], seed=11)
    return [*base, base[1] + [9, 4, 2]]


def params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 17, 30, 9)
    ] + [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[3, 50])]


def run(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params(), use_tqdm=False)]
