"""Teacher-forced agreement: every engine reads the same token streams, and each position's
log-probabilities are compared with a reference's.

Greedy generation cannot tell a bug from a near-tie: once two engines pick different
tokens at a tie their streams part, and on random weights ties are everywhere. Fed the
same stream, two engines see the same context at every position, so their disagreement
there is the model's error alone. Two figures per position:

- the log-probability each assigns to the stream's next token (always reported, by every
  host's prompt logprobs), whose absolute difference measures the error in nats;
- the top-1 token, which agrees except where the reference's two best tokens are closer
  than the error ("decisive" positions are those with a wider margin).

What counts as close enough is measured, not assumed: HF transformers in the engines'
dtype against HF in float32 gives the rounding floor of that dtype on that model.
"""

from __future__ import annotations

from dataclasses import dataclass

# Positions where the reference's top-1 leads its top-2 by at least this many nats are
# decisive: an engine within the dtype's error must pick the same token there.
DECISIVE_MARGIN = 0.1
# Absolute allowances added to the floor-derived bounds (nats, and top-1 fraction).
LOGPROB_SLACK = 0.01
TOP1_SLACK = 0.02
# float32 on both sides: every difference is accumulation order.
FLOAT32_MEAN_DIFF = 2e-3


@dataclass(frozen=True)
class Position:
    """One stream position: the logprob of the stream's next token, and the engine's best
    tokens as (token, logprob), best first."""

    target: float
    top: list[tuple[int, float]]


def from_entries(entries: list[dict[int, float] | None], stream: list[int]) -> list[Position]:
    """Positions from prompt logprobs as vLLM and ATOM report them: one {token: logprob}
    dict per prompt token (None for the first), holding the prompt token and the top-k."""
    rows = entries[1:] if entries and entries[0] is None else entries
    if len(rows) != len(stream) - 1:
        raise ValueError(f"{len(rows)} prompt logprob entries for a {len(stream)}-token stream")
    return [
        Position(row[token], sorted(row.items(), key=lambda kv: -kv[1]))
        for row, token in zip(rows, stream[1:])
    ]


def from_logprobs(logprobs, stream: list[int], k: int) -> list[Position]:
    """Positions from a [len(stream) - 1, vocab] tensor of log-softmaxed logits."""
    import torch

    targets = torch.tensor(stream[1:], device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, targets)[:, 0].tolist()
    values, ids = logprobs.topk(k, dim=-1)
    return [
        Position(target, list(zip(row_ids, row_values)))
        for target, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist())
    ]


def to_json(streams: list[list[Position]]) -> list[list[list]]:
    return [[[p.target, [list(t) for t in p.top]] for p in stream] for stream in streams]


def from_json(streams: list[list[list]]) -> list[list[Position]]:
    return [[Position(target, [tuple(t) for t in top]) for target, top in s] for s in streams]


def decisive_margin(floor: dict | None) -> float:
    """The reference's top-1 lead that the dtype's error cannot overturn: a few times the
    floor's mean error, never below DECISIVE_MARGIN."""
    return max(DECISIVE_MARGIN, 4 * floor["mean_abs_diff"]) if floor else DECISIVE_MARGIN


def compare(
    got: list[list[Position]], want: list[list[Position]], margin: float = DECISIVE_MARGIN
) -> dict:
    """How far `got`'s positions are from the reference `want`'s, over all streams;
    positions where `want` leads by `margin` nats or more are decisive."""
    diffs: list[float] = []
    same_top1 = decisive = same_decisive = 0
    worst = (0.0, 0, 0)
    for s, (stream_got, stream_want) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(stream_got, stream_want, strict=True)):
            diff = abs(g.target - w.target)
            diffs.append(diff)
            worst = max(worst, (diff, s, i))
            agree = g.top[0][0] == w.top[0][0]
            same_top1 += agree
            if len(w.top) > 1 and w.top[0][1] - w.top[1][1] >= margin:
                decisive += 1
                same_decisive += agree
    return dict(
        positions=len(diffs),
        top1_agreement=same_top1 / len(diffs),
        decisive_margin=margin,
        decisive_positions=decisive,
        decisive_agreement=same_decisive / decisive if decisive else 1.0,
        decisive_flips=decisive - same_decisive,
        mean_abs_diff=sum(diffs) / len(diffs),
        max_abs_diff=worst[0],
        worst_position=[worst[1], worst[2]],
    )


def verdict(metrics: dict, floor: dict | None, noise_sources: int) -> tuple[bool, str]:
    """Whether `metrics` are within what rounding explains, and the bound that decided.

    `floor` is HF in the engines' dtype against HF in float32 (None when the engines run
    float32). `noise_sources` is how many sides of the comparison round: 1 against the
    float32 reference, 2 between two engines in the same low precision."""
    if floor is None:
        mean_bound, top1_bound = FLOAT32_MEAN_DIFF, 1.0 - TOP1_SLACK
    else:
        mean_bound = 2 * noise_sources * floor["mean_abs_diff"] + LOGPROB_SLACK
        top1_bound = 1.0 - noise_sources * (1.0 - floor["top1_agreement"]) - TOP1_SLACK
        top1_bound = max(top1_bound, 0.0)
    # One flip is allowed whatever the count: with few decisive positions (a dtype whose
    # floor error is large leaves few) a single one would otherwise decide the verdict.
    flips_allowed = 1 + int(TOP1_SLACK * metrics["decisive_positions"])
    ok = (
        metrics["mean_abs_diff"] <= mean_bound
        and metrics["top1_agreement"] >= top1_bound
        and metrics["decisive_flips"] <= flips_allowed
    )
    return ok, (
        f"mean |dlogp| <= {mean_bound:.3g}, top-1 >= {top1_bound:.3f}, "
        f"decisive flips <= {flips_allowed}"
    )
