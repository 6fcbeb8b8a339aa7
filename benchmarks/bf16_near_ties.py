"""How far bf16 alone moves the greedy token of an `atom bench` shape's random checkpoint.

`atom bench` compares the greedy tokens of two engines in bf16 on random weights. Where
they part early, the question is whether one of them computes something else or whether
the checkpoint's next-token logits are so close that bf16 rounding alone flips the
argmax. This script answers it without any engine: HF transformers' own model on the
shape (fewer layers, so fp32 fits on a CPU), the same weights in bf16 and in fp32, the
last-position logits of random prompts. It prints how many first tokens agree, the
median gap between the fp32 top two logits, and the median of the largest bf16 error of
a prompt's logits: an error near or above the gap means bf16 near-ties.

    python benchmarks/bf16_near_ties.py --shape gpt-oss-20b --layers 2
"""

from __future__ import annotations

import argparse
import time

import torch

from atom.bench.checkpoint import random_model
from atom.bench.shapes import SHAPES


def last_logits(model: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(p[None]).logits[0, -1].float() for p in prompts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()

    shape = SHAPES[args.shape]
    fields = shape.fields | {"num_hidden_layers": args.layers}
    start = time.perf_counter()
    model = random_model(shape.config_class, shape.architecture, fields, "cpu").eval()
    print(f"{args.shape}, {args.layers} layers: built in {time.perf_counter() - start:.0f} s")
    prompts = torch.randint(
        0,
        model.config.vocab_size,
        (args.prompts, args.prompt_len),
        generator=torch.Generator().manual_seed(1),
    )
    bf16 = last_logits(model, prompts)
    fp32 = last_logits(model.float(), prompts)

    top_two = fp32.topk(2, dim=-1).values
    gap = (top_two[:, 0] - top_two[:, 1]).median().item()
    error = (bf16 - fp32).abs().amax(dim=-1).median().item()
    agree = int((bf16.argmax(-1) == fp32.argmax(-1)).sum())
    print(f"first tokens equal in bf16 and fp32: {agree} of {args.prompts}")
    print(f"median fp32 top-1 minus top-2 logit {gap:.3f}; median largest bf16 error {error:.3f}")
    print(f"error / gap {error / gap:.2f} (near or above 1: bf16 alone flips greedy tokens)")


if __name__ == "__main__":
    main()
