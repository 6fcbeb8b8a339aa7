"""KernelPolicy: which implementation (aiter, triton, torch) runs each op (docs/architecture.md).

Every op module registers its implementations with `@register(op, backend)` and calls
`dispatch(op, device)` in its public function. The torch reference is always present
and defines what is correct; faster backends are used where the device supports them.
`ATOM_KERNELS=torch|triton|aiter` forces one backend (falling back to torch for ops that
backend does not provide).

The policy knows the faster backends only through `register_backend` (atom.kernels.backends
declares them), so it never imports the implementations that import it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

BACKENDS = ("aiter", "triton", "torch")

_IMPLS: dict[str, dict[str, Callable]] = {}
# backend -> load(device_type): registers the backend's implementations and says whether
# that device type can run them.
_BACKEND_LOADERS: dict[str, Callable[[str], bool]] = {}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")

    def decorator(fn: Callable) -> Callable:
        _IMPLS.setdefault(op, {})[backend] = fn
        _select.cache_clear()
        return fn

    return decorator


def register_backend(backend: str, load: Callable[[str], bool]) -> None:
    """Declares a backend other than the torch reference. `load(device_type)` runs the first
    time a device type dispatches: it imports the backend's implementations (which register
    themselves) where the device can run them, and returns whether it can."""
    if backend not in BACKENDS or backend == "torch":
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS[:-1]}")
    _BACKEND_LOADERS[backend] = load
    _device_backends.cache_clear()
    _select.cache_clear()


def capturable(fn: Callable) -> Callable:
    """Marks an implementation that never waits on the host (no data-dependent shapes or
    .item()), so a CUDA graph can capture it."""
    fn.cuda_graph_safe = True
    return fn


def capturable_up_to(query_tokens: int) -> Callable[[Callable], Callable]:
    """Marks an implementation that never waits on the host in steps of at most
    `query_tokens` new tokens per sequence (the host's `max_query_len` says so); a longer
    step may read its lengths on the host."""

    def mark(fn: Callable) -> Callable:
        fn.cuda_graph_safe = True
        fn.cuda_graph_max_query_tokens = query_tokens
        return fn

    return mark


def _forced_backend() -> str | None:
    value = os.environ.get("ATOM_KERNELS", "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"ATOM_KERNELS={value!r} is not one of {BACKENDS}")
    return value


@functools.cache
def _device_backends(device_type: str) -> tuple[str, ...]:
    """Backends usable on a device type, fastest first; the torch reference runs everywhere."""
    usable = tuple(
        backend
        for backend in BACKENDS
        if backend in _BACKEND_LOADERS and _BACKEND_LOADERS[backend](device_type)
    )
    return (*usable, "torch")


@functools.cache
def _select(op: str, device_type: str, forced: str | None, skip: str | None = None) -> Callable:
    impls = _IMPLS.get(op)
    if not impls:
        raise KeyError(f"no kernel registered for op {op!r}")
    candidates = _device_backends(device_type)
    if forced is not None:
        candidates = tuple(b for b in candidates if b == forced) + ("torch",)
    for backend in candidates:
        if backend != skip and backend in impls:
            return impls[backend]
    raise KeyError(f"op {op!r} has no implementation for device {device_type!r}")


def dispatch(op: str, device: torch.device) -> Callable:
    return _select(op, device.type, _forced_backend())


def fallback(op: str, device: torch.device, declining: str) -> Callable:
    """What `dispatch` would pick if backend `declining` did not offer `op`: for an
    implementation that cannot take some input (dtype, shape) and hands it on."""
    return _select(op, device.type, _forced_backend(), declining)


def is_capturable(op: str, device: torch.device, query_tokens: int = 1) -> bool:
    """Whether the implementation `op` dispatches to on `device` can run in a CUDA graph,
    in steps of `query_tokens` new tokens per sequence."""
    fn = dispatch(op, device)
    limit = getattr(fn, "cuda_graph_max_query_tokens", query_tokens)
    return getattr(fn, "cuda_graph_safe", False) and query_tokens <= limit


def selected_backend(op: str, device: torch.device | str) -> str:
    """Name of the backend `dispatch` would pick (for logs and tests)."""
    fn = dispatch(op, torch.device(device))
    return next(name for name, impl in _IMPLS[op].items() if impl is fn)


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {op: tuple(impls) for op, impls in sorted(_IMPLS.items())}
