"""The fused-MoE layer that benchmarks/moe.py times and benchmarks/moe_sweep.py tunes: one
Qwen3-30B-A3B expert layer (128 experts, top-8, hidden 2048, intermediate 768) with seeded
random weights, bf16 or FP8 with 128x128 block scales, the same in every process; and how
an output is checked against the torch reference."""

from __future__ import annotations

import contextlib
import functools

import torch

from atom.kernels.fp8 import quantize_fp8_per_block
from atom.kernels.moe import topk_softmax_torch
from atom.kernels.triton.fused_moe import GemmTiles, MoEConfig

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
BLOCK = (128, 128)


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 [E, N, K] and scales [E, N/128, K/128]. One expert at a time: the
    whole w13's fp32 temporaries peak near 8 GB per process, more than sixteen sweep
    workers at once can have."""
    q, scales = zip(*(quantize_fp8_per_block(expert, BLOCK) for expert in w))
    return torch.stack(q), torch.stack(scales)


@functools.lru_cache(maxsize=1)  # one format at a time: a sweep worker sees both
def expert_weights(fmt: str) -> dict:
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    if fmt == "bf16":
        return dict(w13=w13, w2=w2, w13_scale=None, w2_scale=None, block_size=None)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    del w13, w2
    torch.cuda.empty_cache()  # the bf16 originals: the other workers need the memory
    return dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, block_size=BLOCK)


def layer_args(fmt: str, num_tokens: int) -> tuple:
    """fused_moe_triton's arguments for one row, the same in every process (seeded)."""
    w = expert_weights(fmt)
    torch.manual_seed(1)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda")
    topk_weights, topk_ids = topk_softmax_torch(logits, TOP_K, True)
    return (x, w["w13"], w["w2"], topk_weights, topk_ids, "silu",
            w["w13_scale"], w["w2_scale"], w["block_size"])  # fmt: skip


@contextlib.contextmanager
def nan_filled_allocations():
    """torch.empty fills with NaN (ints: their maximum): an output a kernel leaves unwritten
    then fails the check, where it could pass on the memory of the config run before it."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def mismatch(got: torch.Tensor, want: torch.Tensor, fp8: bool) -> str | None:
    """None when got matches the torch reference, else how it differs. FP8 tolerates a rare
    far element (1 in 1,000): both quantize the intermediate activations, and a bf16
    rounding apart moves one by an fp8 step (1/8)."""
    got, want = got.float(), want.float()
    error = ((got - want).norm() / want.norm()).item()
    far = (~torch.isclose(got, want, atol=5e-2, rtol=5e-2)).float().mean().item()
    if error < (3e-2 if fp8 else 1e-2) and far <= (1e-3 if fp8 else 0):  # False for NaN
        return None
    return f"relative error {error:.3g}, {far:.2%} of elements far off"


def describe(config: MoEConfig) -> str:
    def tiles(t: GemmTiles, gated: bool) -> str:
        form = (" stacked" if t.stacked else " pair") if gated else ""
        return f"n{t.block_n} k{t.block_k} group{t.group_m} w{t.num_warps} s{t.num_stages}{form}"

    return (f"block_m {config.block_m} | gate_up {tiles(config.gate_up, True)} | "
            f"down {tiles(config.down, False)}")  # fmt: skip
