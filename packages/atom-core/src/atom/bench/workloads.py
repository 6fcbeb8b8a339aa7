"""Workloads (N prompts x input length -> output length) and their random prompts."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

DEFAULT_WORKLOADS = "1x128->256,256x512->256,1024x512->256"
_PATTERN = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:->|x)\s*(\d+)\s*$")


class BenchError(ValueError):
    """A bad `atom bench` option, with what would be accepted."""


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int

    @property
    def name(self) -> str:
        return f"{self.num_prompts}x{self.input_len}->{self.output_len}"

    @property
    def total_len(self) -> int:
        return self.input_len + self.output_len


def parse_workloads(text: str) -> list[Workload]:
    """'1x128->256,256x512->256' (or 1x128x256) -> workloads, in the given order."""
    workloads = []
    for item in text.split(","):
        match = _PATTERN.match(item)
        if not match:
            raise BenchError(
                f"workload {item.strip()!r} is not N x INPUT -> OUTPUT (e.g. 256x512->256)"
            )
        n, isl, osl = map(int, match.groups())
        if min(n, isl, osl) < 1:
            raise BenchError(f"workload {item.strip()!r}: every number must be >= 1")
        workloads.append(Workload(n, isl, osl))
    if len(set(workloads)) != len(workloads):
        raise BenchError(f"workloads {text!r} repeat one")
    return workloads


def make_prompts(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, the same for every engine given the same seed and workload.

    The lowest ids are left out: they are often special tokens (BOS/EOS/pad)."""
    rng = random.Random(f"{seed}:{workload.name}")
    low = min(100, vocab_size // 4)
    return [
        [rng.randrange(low, vocab_size) for _ in range(workload.input_len)]
        for _ in range(workload.num_prompts)
    ]


def warmup_workload(workload: Workload) -> Workload:
    """The untimed run before the timed one: the same batch shapes (so every kernel
    variant, graph and allocator pool the timed run needs exists), a few output tokens."""
    return Workload(workload.num_prompts, workload.input_len, 8)
