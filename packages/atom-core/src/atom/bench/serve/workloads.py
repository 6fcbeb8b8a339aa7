"""Serving workloads: length distributions and the requests they make.

Prompts are random token ids (the same for every engine given the seed), so the input
length is exact on any server and neither side needs a tokenizer; the chat endpoint gets
the same ids as words. Spellings (`parse_serve_workloads`):

    random:IN:OUT               IN, OUT: a length N or a uniform range LO-HI, e.g. 128-2048
    sharegpt                    long-tailed lengths shaped like ShareGPT's (see below)
    shared-prefix:GxP:IN:OUT    G prefixes of P tokens, each request one of them + IN new
    long[:IN:OUT]               long context, default 32768 -> 128, 16 requests
    ...@N                       N requests instead of --num-prompts, e.g. random:512:128@64
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from atom.bench.workloads import BenchError
from atom.demo import WORDS


@dataclass(frozen=True)
class UniformLengths:
    low: int
    high: int  # inclusive; low == high is a fixed length

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class LogNormalLengths:
    median: float
    sigma: float
    low: int
    high: int  # samples are clipped to [low, high]

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))


Lengths = UniformLengths | LogNormalLengths

# A local stand-in for the ShareGPT conversations that `vllm bench serve` and
# sglang.bench_serving replay: many short turns and a long tail (means about 230 tokens in
# and out). Not the data set, its shape: no network and the same requests on every host.
SHAREGPT_INPUT = LogNormalLengths(median=128, sigma=1.1, low=4, high=2048)
SHAREGPT_OUTPUT = LogNormalLengths(median=160, sigma=0.9, low=4, high=1024)

LONG_CONTEXT = ("32768", "128")
LONG_CONTEXT_REQUESTS = 16  # each prefills 32k tokens: 16 keep a rate within minutes


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class ServeWorkload:
    name: str  # as spelled on the command line
    input: Lengths
    output: Lengths
    num_prompts: int | None = None  # None: the command's --num-prompts
    prefix_len: int = 0
    prefix_groups: int = 1

    @property
    def longest(self) -> int:
        """The longest sequence a request can reach (prompt + output)."""
        return self.prefix_len + self.input.high + self.output.high

    def requests(self, count: int, vocab_size: int, seed: str) -> list[Request]:
        """`count` requests drawn from `seed`; shared-prefix requests take the prefixes in
        turn, so neighbours in time hit different ones."""
        rng = random.Random(f"{seed}:{self.name}")
        low = min(100, vocab_size // 4)  # the lowest ids are often special tokens

        def ids(n: int) -> list[int]:
            return [rng.randrange(low, vocab_size) for _ in range(n)]

        prefixes = [ids(self.prefix_len) for _ in range(self.prefix_groups)]
        return [
            Request(
                prefixes[i % self.prefix_groups] + ids(self.input.sample(rng)),
                self.output.sample(rng),
            )
            for i in range(count)
        ]


def as_text(prompt: list[int]) -> str:
    """A token-id prompt as words, for the chat endpoint (one word per id)."""
    return " ".join(WORDS[t % len(WORDS)] for t in prompt)


_LENGTH = re.compile(r"^(\d+)(?:-(\d+))?$")
_PREFIX = re.compile(r"^(?:(\d+)x)?(\d+)$")


def _lengths(text: str, item: str) -> UniformLengths:
    match = _LENGTH.match(text)
    if not match:
        raise BenchError(f"workload {item!r}: {text!r} is not a length N or a range LO-HI")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if not 1 <= low <= high:
        raise BenchError(f"workload {item!r}: lengths must satisfy 1 <= LO <= HI")
    return UniformLengths(low, high)


def _parse_one(item: str) -> ServeWorkload:
    spec, at, count = item.partition("@")
    kind, *fields = spec.split(":")
    if at and not (count.isdigit() and int(count) >= 1):
        raise BenchError(f"workload {item!r}: the count after '@' must be >= 1")
    num_prompts = int(count) if at else None
    if kind == "random" and len(fields) == 2:
        return ServeWorkload(
            item, _lengths(fields[0], item), _lengths(fields[1], item), num_prompts
        )
    if kind == "long" and len(fields) in (0, 2):
        isl, osl = fields or LONG_CONTEXT
        return ServeWorkload(
            item, _lengths(isl, item), _lengths(osl, item), num_prompts or LONG_CONTEXT_REQUESTS
        )
    if kind == "sharegpt" and not fields:
        return ServeWorkload(item, SHAREGPT_INPUT, SHAREGPT_OUTPUT, num_prompts)
    if kind == "shared-prefix" and len(fields) == 3:
        match = _PREFIX.match(fields[0])
        if not match or int(match.group(2)) < 1 or int(match.group(1) or 1) < 1:
            raise BenchError(f"workload {item!r}: the prefix is P or GxP, both >= 1")
        return ServeWorkload(
            item,
            _lengths(fields[1], item),
            _lengths(fields[2], item),
            num_prompts,
            prefix_len=int(match.group(2)),
            prefix_groups=int(match.group(1) or 1),
        )
    raise BenchError(
        f"workload {item!r}: use random:IN:OUT, sharegpt, shared-prefix:GxP:IN:OUT or "
        "long[:IN:OUT], optionally followed by @N"
    )


def parse_serve_workloads(text: str) -> list[ServeWorkload]:
    workloads = [_parse_one(item.strip()) for item in text.split(",") if item.strip()]
    if not workloads:
        raise BenchError("no workload given")
    if len({w.name for w in workloads}) != len(workloads):
        raise BenchError(f"workloads {text!r} repeat one")
    return workloads
