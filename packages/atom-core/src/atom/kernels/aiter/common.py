"""What the aiter adapters share: the dtypes aiter's kernels take and the hand-off."""

from __future__ import annotations

from collections.abc import Callable

import aiter
import torch

from atom.kernels.fp8 import FP8_DTYPE
from atom.kernels.policy import fallback

# aiter's norm and activation kernels are built for the half types (fp32 only in some
# releases), so the adapters take these and hand the rest on.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def next_backend(op: str, device: torch.device) -> Callable:
    """The implementation to use for an input the aiter adapter declines."""
    return fallback(op, device, "aiter")


def aiter_fp8_is_atoms() -> bool:
    # aiter.dtypes.fp8 is float8_e4m3fnuz on gfx942 (max 240, other bias): ATOM's e4m3fn
    # bytes would be read as different numbers there.
    return aiter.dtypes.fp8 == FP8_DTYPE
