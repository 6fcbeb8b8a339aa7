"""Turns a step's logits [B, vocab] into next tokens, the whole batch at once.

Every row has its own SamplingParams; each feature (penalties, temperature, top-k, top-p,
min-p, logprobs) runs as a few batched tensor ops over the rows that use it, and the
results come to the host in one copy per step. Random rows draw with the exponential-race
trick (argmax of p / Exp(1) noise is a draw from p), so one noise tensor serves the batch;
seeded rows draw their noise from their own device generator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as Rows
from dataclasses import dataclass

import numpy as np
import torch

from atom.engine.compile import compiled
from atom.engine.logits_processors import apply_logits_processors, needs_processing
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def padded_ids(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """Ragged token-id lists as one [R, max_len] device tensor, padded with `pad`."""
    table = np.full((len(rows), max(map(len, rows), default=0) or 1), pad, dtype=np.int64)
    for i, ids in enumerate(rows):
        table[i, : len(ids)] = ids
    return torch.from_numpy(table).to(device, non_blocking=True)


def token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, vocab] occurrence counts of each row's token ids."""
    ids = padded_ids(rows, vocab, device)  # the pad id lands in a column that is dropped
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)[:, None]


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition (HF semantics: over prompt and output), presence and frequency (over the
    output) penalties, applied in place to the rows that ask for them."""
    vocab = logits.shape[-1]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = token_counts([prompt_ids[i] + output_ids[i] for i in rep], vocab, logits.device)
        penalty = _column([params[i].repetition_penalty for i in rep], logits)
        rows = logits[rep]
        scaled = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits[rep] = torch.where(seen > 0, scaled, rows)
    additive = [
        i
        for i, p in enumerate(params)
        if output_ids[i] and (p.presence_penalty or p.frequency_penalty)
    ]
    if additive:
        counts = token_counts([output_ids[i] for i in additive], vocab, logits.device)
        frequency = _column([params[i].frequency_penalty for i in additive], logits)
        presence = _column([params[i].presence_penalty for i in additive], logits)
        logits[additive] -= frequency * counts + presence * (counts > 0)
    return logits


def filter_columns(
    params: list[SamplingParams], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-row (temperature, top_k, top_p, min_p) columns [R, 1] for `filter_scaled`; a
    filter no row uses is None, so its work is skipped."""
    vocab = like.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    return (
        _column([p.temperature for p in params], like),
        torch.tensor(top_k).to(like.device, non_blocking=True)[:, None]
        if min(top_k) < vocab
        else None,
        _column(top_p, like) if min(top_p) < 1.0 else None,
        _column(min_p, like) if max(min_p) > 0 else None,
    )


def filter_scaled(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Temperature-scaled logits [R, vocab] with each row's top-k, top-p and min-p applied
    (-inf elsewhere); the columns come from `filter_columns`."""
    logits = logits / temperature
    if top_k is not None or top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)
        if top_k is not None:
            threshold = sorted_logits.gather(1, top_k - 1)
            logits = logits.masked_fill(logits < threshold, NEG_INF)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, NEG_INF)
        if top_p is not None:
            probs = sorted_logits.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays);
            # rows with top_p == 1 keep everything even where rounding lifts the sum past 1.
            remove = ((probs.cumsum(-1) - probs) >= top_p) & (top_p < 1.0)
            logits = logits.scatter(1, order, sorted_logits.masked_fill(remove, NEG_INF))
    if min_p is not None:
        probs = logits.softmax(-1)
        floor = min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, NEG_INF)
    return logits


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`filter_scaled` with the rows' own params. Rows must not be greedy."""
    return filter_scaled(logits, *filter_columns(params, logits))


def draw(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row [R] from the filtered distribution, given Exp(1) `noise` [R, vocab]."""
    probs = filter_scaled(logits, temperature, top_k, top_p, min_p).softmax(-1)
    return (probs / noise).argmax(-1)


def pick(
    logits: torch.Tensor, drawn: torch.Tensor | None = None, index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B] (the argmax, except rows `index` take `drawn`; every row when index is
    None) and [B, 2] float64 rows (token, its logprob) for the host copy. The logprob is a
    log_softmax of `logits`, the model's view of each token before temperature."""
    tokens = logits.argmax(-1)
    if drawn is not None:
        tokens = drawn if index is None else tokens.index_put((index,), drawn)
    chosen = logits.gather(1, tokens[:, None]) - logits.logsumexp(-1, keepdim=True)
    return tokens, torch.cat([tokens[:, None].double(), chosen.double()], 1)


def topk_columns(logprobs: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The top-k ids and values of each row, as float64 columns for a packed host copy."""
    if not k:
        return []
    values, ids = logprobs.topk(k, dim=-1)
    return [ids.double(), values.double()]


def unpack_entry(row: list[float], k: int, width: int) -> dict[int, float]:
    """{token: logprob} from a packed host row [token, logprob, width ids, width values]."""
    entry = {int(row[0]): row[1]}
    entry.update(zip(map(int, row[2 : 2 + k]), row[2 + width : 2 + width + k]))
    return entry


def prompt_logprob_entries(
    logits: torch.Tensor, targets: list[int], k: int
) -> list[dict[int, float]]:
    """One {token: logprob} entry per row of `logits`: its target token plus its top k."""
    logprobs = logits.log_softmax(-1)
    target = torch.tensor(targets).to(logits.device, non_blocking=True)[:, None]
    packed = torch.cat(
        [target.double(), logprobs.gather(1, target).double(), *topk_columns(logprobs, k)], 1
    )
    return [unpack_entry(row, k, k) for row in packed.cpu().tolist()]


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


@functools.cache
def compiled_pick() -> Callable:
    """One compiled `pick` per process, shared by every engine's sampler.

    `draw` stays eager: inductor (torch 2.11, Triton backend) fails to generate the
    split cumsum of its top-p filter over a 151,936-wide vocabulary."""
    return compiled(pick)


class Sampler:
    """compile: run `pick` (the greedy tokens and logprobs of a step) through torch.compile;
    the filtered sampling, penalties, blocked tokens and noise draws stay eager."""

    def __init__(self, seed: int = 0, compile: bool = False):
        self.seed = seed
        self.default_generators: dict[torch.device, torch.Generator] = {}
        self.draw, self.pick = draw, compiled_pick() if compile else pick

    def default_generator(self, device: torch.device) -> torch.Generator:
        if device not in self.default_generators:
            self.default_generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self.default_generators[device]

    @staticmethod
    def _seeded_rows(seqs: list[Sequence], device: torch.device):
        """(row, the sequence's own generator) of each seeded sequence."""
        for i, seq in enumerate(seqs):
            if seq.seed is not None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device).manual_seed(seq.seed)
                yield i, seq.generator

    def noise_for(self, seqs: list[Sequence], like: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise [R, vocab]; seeded sequences draw theirs from their own generator."""
        noise = torch.empty_like(like).exponential_(generator=self.default_generator(like.device))
        for i, generator in self._seeded_rows(seqs, like.device):
            noise[i].exponential_(generator=generator)
        # A zero draw would turn a filtered (p = 0) token into 0/0.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def uniform_for(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """U(0, 1) draws [R]; seeded sequences draw theirs from their own generator."""
        u = torch.empty(len(seqs), device=device).uniform_(generator=self.default_generator(device))
        for i, generator in self._seeded_rows(seqs, device):
            u[i : i + 1].uniform_(generator=generator)
        return u

    def launch(
        self, logits: torch.Tensor, seqs: list[Sequence], blocked: Rows[Rows[int]] = ()
    ) -> PendingSamples:
        """Starts sampling one token per row of fp32 `logits` [B, vocab] (modified in
        place), row i following seqs[i].params (and its guide); blocked[i] lists token ids
        row i may not pick (EOS under min_tokens). Nothing waits for the device."""
        params = [seq.params for seq in seqs]
        penalised = [uses_penalties(p) for p in params]
        if any(penalised):
            apply_penalties(
                logits,
                params,
                [seq.prompt_ids if used else [] for seq, used in zip(seqs, penalised)],
                [seq.output_ids if used else [] for seq, used in zip(seqs, penalised)],
            )
        if needs_processing(seqs):
            apply_logits_processors(logits, seqs)
        pairs = [(i, t) for i, ids in enumerate(blocked) for t in ids]
        if pairs:
            rows, cols = zip(*pairs)
            logits[list(rows), list(cols)] = NEG_INF
        drawn = index = None
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            every_row = len(random_rows) == len(params)
            if not every_row:
                index = torch.tensor(random_rows).to(logits.device, non_blocking=True)
            sampled = logits if every_row else logits[index]
            columns = filter_columns([params[i] for i in random_rows], sampled)
            noise = self.noise_for([seqs[i] for i in random_rows], sampled)
            drawn = self.draw(sampled, noise, *columns)
        tokens, packed = self.pick(logits, drawn, index)
        k = max((p.logprobs or 0 for p in params), default=0)
        if k:
            packed = torch.cat([packed, *topk_columns(logits.log_softmax(-1), k)], 1)
        return PendingSamples(tokens, packed, params, k)

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], blocked: Rows[Rows[int]] = ()
    ) -> list[SampleResult]:
        return self.launch(logits, seqs, blocked).results()


class HostCopy:
    """One asynchronous device-to-host copy of a packed result tensor."""

    def __init__(self, packed: torch.Tensor):
        self.host = packed.to("cpu", non_blocking=True)  # pinned when it comes from a GPU
        self.copied = None
        if packed.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def rows(self) -> list[list[float]]:
        """The copied rows, once the copy has landed."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class PendingSamples:
    """A batch's sampled tokens: on the device at once (to feed the next step), on the
    host after one asynchronous copy of the packed results."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, params, k: int):
        self.tokens = tokens
        self.params = params
        self.k = k
        self.copy = HostCopy(packed)

    def results(self) -> list[SampleResult]:
        results = []
        for p, row in zip(self.params, self.copy.rows()):
            entry = unpack_entry(row, p.logprobs, self.k) if p.logprobs is not None else None
            results.append(SampleResult(int(row[0]), row[1], entry))
        return results
