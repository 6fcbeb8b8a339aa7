"""ATOM: hand-tuned LLM models and kernels for vLLM, SGLang and a native engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from atom.engine.llm import LLM
    from atom.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy, so `import atom` (e.g. from a host plugin's register()) stays cheap.
    if name == "LLM":
        from atom.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from atom.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'atom' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
