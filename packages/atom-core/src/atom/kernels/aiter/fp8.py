"""FP8 per-token-group quantization and the 128x128 block-scale GEMM through aiter.

Quantization follows aiter/ops/quant.py (get_hip_quant(QuantType.per_1x128): scales
[M, K / 128], row-major, as ATOM's); the GEMM aiter/ops/gemm_op_a8w8.py
(gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype) with plain [N, K] weights and
[N / 128, K / 128] weight scales, as ATOM's checkpoints). Both take only e4m3fn (see
common.aiter_fp8_is_atoms) and whole 128-wide groups; everything else is handed on.
"""

from __future__ import annotations

import aiter
import torch

from atom.kernels.aiter.common import HALF_DTYPES, aiter_fp8_is_atoms, next_backend
from atom.kernels.policy import register

_GROUP = 128


@register("quantize_fp8_per_token_group", "aiter")
def quantize_fp8_per_token_group_aiter(x: torch.Tensor, group_size: int):
    takes = (
        group_size == _GROUP
        and x.dim() == 2
        and x.numel() > 0
        and x.shape[1] % _GROUP == 0
        and x.dtype in HALF_DTYPES
        and aiter_fp8_is_atoms()
    )
    if not takes:
        return next_backend("quantize_fp8_per_token_group", x.device)(x, group_size)
    quantize = aiter.get_hip_quant(aiter.QuantType.per_1x128)
    return quantize(x.contiguous(), quant_dtype=aiter.dtypes.fp8)


def _takes_block_mm(a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size) -> bool:
    if block_size is None or tuple(block_size) != (_GROUP, _GROUP) or bias is not None:
        return False
    (m, k), n = a_q.shape, b_q.shape[0]
    return (
        m > 0
        and k % _GROUP == 0
        and n % _GROUP == 0
        and a_q.dtype == b_q.dtype == aiter.dtypes.fp8
        and aiter_fp8_is_atoms()
        and out_dtype in HALF_DTYPES
        and a_scale.dtype == b_scale.dtype == torch.float32
        and tuple(a_scale.shape) == (m, k // _GROUP)
        and tuple(b_scale.shape) == (n // _GROUP, k // _GROUP)
    )


@register("fp8_scaled_mm", "aiter")
def fp8_scaled_mm_aiter(a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size):
    if not _takes_block_mm(a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size):
        return next_backend("fp8_scaled_mm", a_q.device)(
            a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size
        )
    return aiter.gemm_a8w8_blockscale(
        a_q.contiguous(), b_q.contiguous(), a_scale.contiguous(), b_scale.contiguous(), out_dtype
    )
