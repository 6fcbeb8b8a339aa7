"""atom-vllm: vLLM runs ATOM's model implementations and attention backend.

vLLM calls `register()` through the `vllm.general_plugins` entry point in every process
it starts (front-end, engine core, workers, the registry's inspection subprocess). It
registers, for every architecture `atom.registry` marks vLLM-capable, a lazy
`"atom_vllm.model:<Architecture>"` class with `ModelRegistry.register_model`, and ATOM's
attention backend under the static `AttentionBackendEnum.CUSTOM` member.

`ATOM_DISABLE_VLLM_PLUGIN=1` turns the plugin off in every process (vLLM then runs its
own classes). Per run, `model_impl="vllm"` (`--model-impl vllm`) makes the registered
classes build vLLM's own implementation instead; `"auto"` and `"atom"` run ATOM's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

__version__ = "0.1.0"

DISABLE_ENV = "ATOM_DISABLE_VLLM_PLUGIN"
BACKEND_PATH = "atom_vllm.attention.AtomAttentionBackend"
MODEL_MODULE = "atom_vllm.model"

logger = logging.getLogger("vllm.atom_vllm")

# Attention kinds this plugin has a vLLM backend for (atom.registry ModelEntry.attention).
ATTENTION_KINDS = ("MHA", "MLA")

_registered: list[str] | None = None


def plugin_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes")


def _say(message: str, *args: object, level: int = logging.INFO, exc_info: bool = False) -> None:
    """Logs through vLLM's logger, or to stderr while vLLM has not configured it yet."""
    if logging.getLogger("vllm").handlers or logger.handlers:
        logger.log(level, message, *args, exc_info=exc_info)
        return
    print(f"[atom_vllm pid={os.getpid()}] " + (message % args), file=sys.stderr)
    if exc_info:
        import traceback

        traceback.print_exc(file=sys.stderr)


def served_architectures() -> list[str]:
    """Registry architectures for host "vllm" whose ATOM module is installed."""
    from atom.registry import all_models

    archs = []
    for entry in all_models():
        if "vllm" not in entry.hosts or entry.attention not in ATTENTION_KINDS:
            continue
        try:
            available = importlib.util.find_spec(entry.module) is not None
        except (ImportError, ValueError):
            available = False
        if available:
            archs.append(entry.architecture)
        else:
            logger.debug("ATOM module %s for %s is not installed", entry.module, entry.architecture)
    return archs


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, cheap, never raises."""
    global _registered
    if plugin_disabled():
        if _registered is None:
            _registered = []
            _say("%s=1: ATOM plugin inactive, vLLM runs its own models", DISABLE_ENV)
        return
    if _registered:
        return
    try:
        archs = served_architectures()
        from vllm import ModelRegistry
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
        for arch in archs:
            ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{arch}")
        _registered = archs
        _say(
            "ATOM %s serves %s in vLLM (attention backend CUSTOM -> %s)",
            __version__,
            ", ".join(archs) or "no architectures",
            BACKEND_PATH,
        )
    except Exception:  # never break vLLM: log and leave it untouched
        _registered = None
        _say(
            "atom_vllm.register() failed; vLLM runs its own models",
            level=logging.ERROR,
            exc_info=True,
        )


__all__ = ["register", "served_architectures", "plugin_disabled", "__version__"]
