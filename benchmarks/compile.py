"""Eager vs torch.compile'd sampler on a CUDA GPU: the per-step cost the engine's
`compile` option changes (atom/engine/compile.py says why only the sampler is compiled).

Times `Sampler.launch` (host work, uploads, kernels, the async copy of results) on fp32
logits [B, vocab], synchronising once per timed loop, so a figure is a step's sampling
cost whichever of host or device bounds it. Usage:
    PYTHONPATH=packages/atom-core/src python benchmarks/compile.py [--vocab 151936]
"""

from __future__ import annotations

import argparse
import time

import torch

from atom.engine.sampler import Sampler
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top-k/top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "top-p/min-p": SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05),
}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_launch(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], iters: int):
    """Milliseconds per launch, after warm-up calls (which compile, when compiled)."""
    for _ in range(3):
        sampler.launch(logits, seqs)
    synchronize(str(logits.device))
    start = time.perf_counter()
    for _ in range(iters):
        samples = sampler.launch(logits, seqs)
    synchronize(str(logits.device))
    return (time.perf_counter() - start) * 1e3 / iters, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch-sizes", default="1,256,1024")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke test")
    args = parser.parse_args()
    samplers = {"eager": Sampler(), "compiled": Sampler(compile=True)}
    print(f"{'case':<13} {'batch':>5} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8}  tokens")
    for name, params in CASES.items():
        for batch in map(int, args.batch_sizes.split(",")):
            torch.manual_seed(0)
            logits = torch.randn(batch, args.vocab, device=args.device) * 4
            seqs = [Sequence([1], params) for _ in range(batch)]
            ms, tokens = {}, {}
            for label, sampler in samplers.items():
                ms[label], samples = time_launch(sampler, logits, seqs, args.iters)
                tokens[label] = samples.tokens
            # Greedy rows must agree exactly; random rows draw fresh noise every call.
            same = torch.equal(tokens["eager"], tokens["compiled"]) if params.greedy else "-"
            print(
                f"{name:<13} {batch:>5} {ms['eager']:>9.3f} {ms['compiled']:>12.3f} "
                f"{ms['eager'] / ms['compiled']:>7.2f}x  {'same' if same is True else same}"
            )
            del logits


if __name__ == "__main__":
    main()
