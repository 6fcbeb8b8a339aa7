"""What Triton kernels need before they build tensor descriptors (TMA) on the device.

`tl.make_tensor_descriptor` writes each program's descriptor to global scratch memory
that Triton asks an allocator for at every launch. Triton keeps the allocator in a
ContextVar, so a setting made once is invisible to other threads (hosts run the model
in worker threads too), and vLLM and SGLang set their own right before their kernels.
`use_scratch_allocator` is therefore called right before each launch: one ContextVar
set. Its allocator is theirs (`torch.empty` on the current device), so leaving it in
place changes nothing for their kernels. The scratch comes from torch's caching
allocator on the launch's stream: under CUDA graph capture it is taken from the graph's
pool and stays valid for every replay; freed right after the launch, it is only reused
by later work on the same stream.
"""

from __future__ import annotations

import torch
import triton

# The Hopper TMA unit: sm_90 and newer.
MIN_CAPABILITY = (9, 0)
ALIGNMENT = 16  # bytes: base address and every stride but the last


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # torch allocations are 256-byte aligned, more than any descriptor asks for.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_scratch_allocator() -> None:
    triton.set_allocator(_scratch)


def tma_supported(device: torch.device) -> bool:
    """TMA exists on the device (the interpreter runs descriptors on the CPU too)."""
    if device.type != "cuda":
        return device.type == "cpu"
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def tma_ready(t: torch.Tensor) -> bool:
    """t's rows can be read through a descriptor: unit channel stride, 16-byte aligned
    base and strides."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % ALIGNMENT == 0
        and all(s * size % ALIGNMENT == 0 for s in t.stride()[:-1])
    )
