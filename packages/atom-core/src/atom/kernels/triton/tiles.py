"""Program-to-tile order shared by ATOM's Triton GEMMs, and the SM count launches size
their grids by."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (1 for the CPU interpreter, which runs one
    program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(M-tile, N-tile) of program `pid`: GROUP_M M-tiles sweep each N-tile before the next
    one starts, so the weight tiles they share are still in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def tile_ranges(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(rows, cols, row_ok, col_ok) of program `pid`'s [BLOCK_M, BLOCK_N] output tile in the
    `grouped_tile` order: its row and column indices and which of them lie inside [M, N]."""
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N
