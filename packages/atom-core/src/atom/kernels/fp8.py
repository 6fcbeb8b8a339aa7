"""FP8 (e4m3) quantization: per tensor, per token, per token group, 128x128 blocks; scaled GEMM.

A scale s means real = fp8 * s (checkpoints call block scales `weight_scale_inv`).
"""

from __future__ import annotations

import torch

from atom.kernels.policy import dispatch, register

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=_MIN_SCALE) / FP8_MAX


def quantize_fp8_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [1]); a dynamic scale (amax / 448) when none is given."""
    if scale is None:
        scale = _amax_scale(x.abs().max()).reshape(1)
    return _to_fp8(x, scale.float()), scale.float().reshape(1)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q, scale [M, 1])."""
    scale = _amax_scale(x.abs().amax(-1, keepdim=True))
    return _to_fp8(x, scale), scale


@register("quantize_fp8_per_token_group", "torch")
def quantize_fp8_per_token_group_torch(x: torch.Tensor, group_size: int):
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group_size)).view(m, -1, group_size)
    scale = _amax_scale(padded.abs().amax(-1, keepdim=True))
    q = _to_fp8(padded, scale).view(m, -1)[:, :k]
    return q, scale.squeeze(-1)


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q, scale [M, ceil(K / group_size)]): DeepSeek's activation format."""
    return dispatch("quantize_fp8_per_token_group", x.device)(x, group_size)


def _expand_block_scale(scale: torch.Tensor, shape: torch.Size, block_size: tuple[int, int]):
    rows = scale.repeat_interleave(block_size[0], 0)[: shape[0]]
    return rows.repeat_interleave(block_size[1], 1)[:, : shape[1]]


def quantize_fp8_per_block(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q, scale [ceil(N / bn), ceil(K / bk)])."""
    bn, bk = block_size
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = _amax_scale(tiles.abs().amax(dim=(1, 3)))
    return _to_fp8(w, _expand_block_scale(scale, w.shape, block_size)), scale


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of the quantizers.

    Without block_size the scale broadcasts: [] or [1] per tensor, [N, 1] per row. With
    block_size (bn, bk) it has one entry per tile, [ceil(N / bn), ceil(K / bk)]; per token
    group scales are tiles of (1, group_size).
    """
    scale = scale.float()
    if block_size is not None:
        scale = _expand_block_scale(scale, q.shape, block_size)
    return (q.float() * scale).to(dtype)


@register("fp8_scaled_mm", "torch")
def fp8_scaled_mm_torch(a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size):
    # In block mode the activation's token groups span one weight tile's K extent (which
    # need not divide K); a per-tensor or per-token scale simply broadcasts.
    grouped = block_size is not None and a_scale.dim() == 2 and a_scale.shape[1] > 1
    a_groups = (1, block_size[1]) if grouped else None
    a = dequantize_fp8(a_q, a_scale, a_groups)
    b = dequantize_fp8(b_q, b_scale, block_size)
    out = a @ b.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_scaled_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """dequant(a) [M, K] @ dequant(b) [N, K]^T (+ bias), fp32 accumulation.

    a_scale: [1], per token [M, 1] or per token group [M, ceil(K / bk)] (block mode);
    b_scale: [1], per channel [N, 1] or block [ceil(N / bn), ceil(K / bk)] (with block_size).
    """
    return dispatch("fp8_scaled_mm", a_q.device)(
        a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size
    )
