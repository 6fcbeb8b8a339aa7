"""Triton implementations, registered with the kernel policy when imported (CUDA and ROCm)."""

from atom.kernels.triton import activation, kv_cache, norm, paged_attention, rotary

__all__ = ["activation", "kv_cache", "norm", "paged_attention", "rotary"]
