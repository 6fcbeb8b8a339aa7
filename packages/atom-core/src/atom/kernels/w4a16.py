"""4-bit weight-only GEMM (W4A16): y = x @ dequant(W) + b, activations in the model dtype.

Every checkpoint format (AWQ, GPTQ, compressed-tensors pack-quantized) is repacked at
load into ONE layout, the one these kernels read:

* `qweight` [K/8, N] int32: unsigned 4-bit codes packed along K, eight per word, code of
  row 8i + j in bits 4j..4j+3 (low nibble first);
* `scales`, `zeros` [G, N] fp32, G = K / group_size: the weight of row k, column n is
  (code - zeros[k // group_size, n]) * scales[k // group_size, n], computed in fp32 and
  rounded once to the activation dtype (fp32 keeps a checkpoint's fp16 scales exact in a
  bf16 model, so the weights equal the checkpoint's dequantized ones in that dtype).

Act-order checkpoints are sorted by group at load; the layer then permutes x's columns
before the GEMM (`atom.layers.quantization.w4a16`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.policy import dispatch, register

PACK_FACTOR = 8  # 4-bit codes per int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] integer codes in [0, 15] -> [K/8, N] int32, packed along K."""
    k, n = codes.shape
    if k % PACK_FACTOR:
        raise ValueError(f"4-bit packing needs K divisible by {PACK_FACTOR}, got K={k}")
    nibbles = codes.to(torch.int32).reshape(k // PACK_FACTOR, PACK_FACTOR, n)
    words = nibbles << _SHIFTS.to(codes.device)[None, :, None]
    # Disjoint bit fields: the sum is their bitwise or (int32 wraps on the top nibble).
    return words.sum(dim=1, dtype=torch.int32)


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """[K/8, N] int32 -> [K, N] int32 codes in [0, 15]; the inverse of `pack_int4_rows`."""
    shifts = _SHIFTS.to(qweight.device)[None, :, None]
    codes = (qweight.unsqueeze(1) >> shifts) & 0xF
    return codes.reshape(-1, qweight.shape[1])


def dequantize_w4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The [K, N] fp32 weight the packed layout stands for."""
    codes = unpack_int4_rows(qweight).float()
    scale = scales.float().repeat_interleave(group_size, dim=0)
    zero = zeros.float().repeat_interleave(group_size, dim=0)
    return (codes - zero) * scale


@register("w4a16_gemm", "torch")
def w4a16_gemm_torch(x, qweight, scales, zeros, group_size, bias):
    # The [N, K] weight through F.linear: the op an unquantized layer with the dequantized
    # weights runs, so both give the same bits.
    w = dequantize_w4(qweight, scales, zeros, group_size).to(x.dtype).T.contiguous()
    return F.linear(x, w, bias)


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(qweight, scales, zeros) [K, N] (+ bias) -> [M, N] in x.dtype.

    group_size: rows per scale group (K for one group per column, i.e. per channel).
    """
    k = x.shape[-1]
    if qweight.shape[0] * PACK_FACTOR != k or k % group_size or scales.shape[0] != k // group_size:
        raise ValueError(
            f"w4a16_gemm: x [.., {k}] does not fit qweight {tuple(qweight.shape)}, "
            f"scales {tuple(scales.shape)} and group_size {group_size}"
        )
    return dispatch("w4a16_gemm", x.device)(x, qweight, scales, zeros, group_size, bias)
