"""atom-vllm: vLLM runs ATOM's model implementations and attention backend.

vLLM calls `register()` through the `vllm.general_plugins` entry point in every process
it starts (front-end, engine core, workers, the registry's inspection subprocess). It
registers, for every architecture `atom.registry` marks vLLM-capable, a lazy
`"atom_vllm.model:<Architecture>"` class with `ModelRegistry.register_model`, and ATOM's
attention backend under the static `AttentionBackendEnum.CUSTOM` member, and installs
the config hooks of `atom_vllm.patches`. For DeepSeek-V3, GLM-4.5, DeepSeek-V3.2 and
GLM-5 it also registers vLLM's MTP draft architectures ("DeepSeekMTPModel",
"Glm4MoeMTPModel", "DeepseekV32MTPModel") to ATOM's drafter (`atom_vllm.mtp`), so
`speculative_config={"method": "mtp", ...}` drafts with ATOM's MTP layers.

`ATOM_DISABLE_VLLM_PLUGIN=1` turns the plugin off in every process (vLLM then runs its
own classes). On a vLLM outside `SUPPORTED` (the tested range) the plugin logs one line
and registers nothing; `ATOM_DISABLE_VLLM_PLUGIN=0` (ATOM asked for explicitly) turns
that into an `UnsupportedHostVersion` error naming both versions. Per run,
`model_impl="vllm"` (`--model-impl vllm`) makes the registered classes build vLLM's own
implementation instead; `"auto"` and `"atom"` run ATOM's.
"""

from __future__ import annotations

import logging

from atom.hosts import plugin as hosts_plugin
from atom.hosts.plugin import HostRange, PluginLog, check_host_version, env_flag, env_flag_off

__version__ = "0.1.0"

DISABLE_ENV = "ATOM_DISABLE_VLLM_PLUGIN"
BACKEND_PATH = "atom_vllm.backend.AtomAttentionBackend"
MODEL_MODULE = "atom_vllm.model"
MTP_DRAFTER_CLASS = "atom_vllm.mtp:AtomMtpDrafter"
# vLLM's draft architectures (method "mtp") -> the targets whose MTP layers ATOM runs as
# that draft (vLLM 0.32 drafts DeepSeek-V3.2 and GLM-5 with the same class).
MTP_DRAFT_ARCHITECTURES = {
    "DeepSeekMTPModel": ("DeepseekV3ForCausalLM",),
    "Glm4MoeMTPModel": ("Glm4MoeForCausalLM",),
    "DeepseekV32MTPModel": ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"),
}
SUPPORTED = HostRange("vLLM", "0.32", "0.33")

logger = logging.getLogger("vllm.atom_vllm")

# Attention kinds this plugin has a vLLM backend for (atom.registry ModelEntry.attention).
ATTENTION_KINDS = ("MHA", "MLA", "compressed")

_registered: list[str] | None = None


def plugin_disabled() -> bool:
    return env_flag(DISABLE_ENV)


# Through vLLM's logger once vLLM has configured it; to stderr before.
_say = PluginLog(logger, [logging.getLogger("vllm"), logger], "atom_vllm")


def served_architectures() -> list[str]:
    """Registry architectures for host "vllm" whose ATOM module is installed."""
    return hosts_plugin.served_architectures(
        "vllm", lambda entry: entry.attention in ATTENTION_KINDS, logger
    )


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent and cheap. It raises only when
    ATOM was asked for explicitly on an untested vLLM (`UnsupportedHostVersion`)."""
    global _registered
    if plugin_disabled():
        if _registered is None:
            _registered = []
            _say("%s=1: ATOM plugin inactive, vLLM runs its own models", DISABLE_ENV)
        return
    if _registered is not None:
        return
    if not check_host_version(SUPPORTED, vllm_version(), env_flag_off(DISABLE_ENV), _say):
        _registered = []
        return
    try:
        archs = served_architectures()
        from vllm import ModelRegistry
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from atom_vllm.patches import install_config_hooks

        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
        for arch in archs:
            ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{arch}")
        for draft, targets in MTP_DRAFT_ARCHITECTURES.items():
            if set(targets) & set(archs):
                ModelRegistry.register_model(draft, MTP_DRAFTER_CLASS)
        install_config_hooks(archs)
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


__all__ = ["register", "served_architectures", "plugin_disabled", "SUPPORTED", "__version__"]
