"""Where a Triton kernel test module runs: the GPU, or the CPU under Triton's interpreter."""

from __future__ import annotations

import os

import torch


def triton_test_device() -> str:
    """ "cuda" with a GPU, "cpu" under TRITON_INTERPRET=1; otherwise skips the calling test
    module (call it at import time, after `pytest.importorskip("triton")`)."""
    import pytest

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip(
        "Triton kernels need a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True
    )
