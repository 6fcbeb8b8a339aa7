"""The kernel backends besides the torch reference, declared to the kernel policy.

Each backend's implementations are imported the first time a device that can run them
dispatches (they register themselves with the policy as they load), so a CPU run never
imports Triton or aiter.
"""

from __future__ import annotations

import importlib.util

import torch

from atom.kernels.policy import register_backend


def _load_aiter(device_type: str) -> bool:
    # aiter only where it is installed on ROCm; it is tried before Triton there.
    if device_type != "cuda" or torch.version.hip is None:
        return False
    if importlib.util.find_spec("aiter") is None:
        return False
    import atom.kernels.aiter  # noqa: F401  (optional dependency: aiter)

    return True


def _load_triton(device_type: str) -> bool:
    if device_type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    import atom.kernels.triton  # noqa: F401  (optional dependency: triton)

    return True


register_backend("aiter", _load_aiter)
register_backend("triton", _load_triton)
