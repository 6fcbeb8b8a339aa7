"""MXFP4 experts (GPT-OSS): the format, and the fused MoE over experts kept packed.

MXFP4 (OCP microscaling) stores 4-bit e2m1 values in groups of 32 along each weight row's
input dimension; a group shares one e8m0 scale, a biased power-of-two exponent. A weight
[N, K] is held as blocks [N, K/32, 16] uint8 (two codes per byte, low nibble first) and
scales [N, K/32] uint8. Stacked experts add a leading expert dim: w13 [E, 2I, H/32, 16]
(gate rows, then up rows, as in `fused_moe`) and w2 [E, H, I/32, 16].
"""

from __future__ import annotations

import torch

from atom.kernels.moe import MoEActivation, fused_moe_torch
from atom.kernels.policy import dispatch, register

# e2m1 code -> magnitude (codes 8-15: the same, negative): 2 exponent bits, 1 mantissa bit.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32
_E8M0_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks [..., G, 16] uint8 (two codes per byte, low nibble first) and scales [..., G]
    uint8 (biased exponents) -> [..., G * 32] values in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
            "pair up (blocks [..., G, 16], scales [..., G])"
        )
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=blocks.device)
    values = torch.cat([magnitudes, -magnitudes])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    exponents = scales.to(torch.int32) - _E8M0_BIAS
    out = torch.ldexp(values[codes], exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def check_mxfp4_experts(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales) -> None:
    """Both implementations' shape contract, with the offending tensor named."""
    num_experts, two_inter = w13_blocks.shape[:2]
    size = hidden.shape[-1]
    expected = {
        "w13_blocks": (num_experts, two_inter, size // MXFP4_GROUP, 16),
        "w13_scales": (num_experts, two_inter, size // MXFP4_GROUP),
        "w2_blocks": (num_experts, size, two_inter // 2 // MXFP4_GROUP, 16),
        "w2_scales": (num_experts, size, two_inter // 2 // MXFP4_GROUP),
    }
    given = dict(w13_blocks=w13_blocks, w13_scales=w13_scales, w2_blocks=w2_blocks,
                 w2_scales=w2_scales)  # fmt: skip
    if size % MXFP4_GROUP or two_inter % (2 * MXFP4_GROUP):
        raise ValueError(
            f"MXFP4 experts: hidden size {size} and intermediate size {two_inter // 2} must "
            f"be multiples of {MXFP4_GROUP}"
        )
    for name, tensor in given.items():
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"MXFP4 experts: {name} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                f"uint8 {expected[name]} for hidden states of width {size}"
            )


@register("fused_moe_mxfp4", "torch")
def fused_moe_mxfp4_torch(
    hidden, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, activation,
    w13_bias=None, w2_bias=None,
):  # fmt: skip
    """Dequantizes the experts this call routes to (not the rest) to the hidden dtype per
    call, then computes as `fused_moe_torch`."""
    check_mxfp4_experts(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales)
    used, local_ids = topk_ids.long().unique(return_inverse=True)
    # Sorted, so ids of experts held by other ranks (>= E) come last and stay >= len(used).
    used = used[used < w13_blocks.shape[0]]
    w13 = dequantize_mxfp4(w13_blocks[used], w13_scales[used], hidden.dtype)
    w2 = dequantize_mxfp4(w2_blocks[used], w2_scales[used], hidden.dtype)
    b13 = None if w13_bias is None else w13_bias[used]
    b2 = None if w2_bias is None else w2_bias[used]
    return fused_moe_torch(
        hidden, w13, w2, topk_weights, local_ids, activation, None, None, None, b13, b2
    )


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_moe` with MXFP4 expert weights (module docstring), weight-only: the hidden
    states and the intermediate activations stay in their dtype, and each weight equals its
    dequantized value in that dtype. Biases as in `fused_moe` (w13_bias [E, 2I], gate
    entries then up entries)."""
    return dispatch("fused_moe_mxfp4", hidden.device)(
        hidden, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids,
        activation, w13_bias, w2_bias,
    )  # fmt: skip
