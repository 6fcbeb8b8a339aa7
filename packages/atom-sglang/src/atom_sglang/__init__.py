"""atom-sglang: SGLang runs ATOM's model implementations and attention backend.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in the processes
that load plugins (the engine's main process and each scheduler). It

* registers ATOM's attention backend in SGLang's attention-backend registry under the
  name `"atom"` and adds that name to the accepted `--attention-backend` choices;
* overrides SGLang's model-registry entries of every architecture `atom.registry` marks
  SGLang-capable with ATOM's wrapper class (`atom_sglang.model.AtomForCausalLM`);
* registers the hooks listed in `atom_sglang.patches`: `support_triton` on SGLang's
  CPU engine where SGLang answers it by the backend's name (0.5.21), and, where ATOM
  serves GPT-OSS, the wrapper of SGLang's model step that lets the "atom" backend pass
  its sinks-and-sliding-window check.

Before anything, it checks the installed SGLang against `SUPPORTED` (the tested range).
Outside it, ATOM stays out of SGLang's way (one log line, nothing registered), unless
the user asked for ATOM explicitly (`ATOM_DISABLE_SGLANG_PLUGIN=0`, or the "atom"
attention backend): then SGLang's launch stops with `UnsupportedHostVersion`
(`atom_sglang.guard` says where and why there).

The same classes are an SGLang external model package without the plugin:
`SGLANG_EXTERNAL_MODEL_PACKAGE=atom_sglang.models`. `ATOM_DISABLE_SGLANG_PLUGIN=1`
turns the plugin off (SGLang then runs its own models and has no "atom" backend);
`ATOM_SGLANG_BACKEND_ONLY=1` registers only the backend (SGLang's own models on it).
"""

from __future__ import annotations

import importlib.metadata
import logging

from atom.hosts import plugin as hosts_plugin
from atom.hosts.plugin import HostRange, PluginLog, check_host_version, env_flag, env_flag_off

__version__ = "0.1.0"

DISABLE_ENV = "ATOM_DISABLE_SGLANG_PLUGIN"
BACKEND_ONLY_ENV = "ATOM_SGLANG_BACKEND_ONLY"  # "1": the "atom" backend, SGLang's models
BACKEND_NAME = "atom"
SUPPORTED = HostRange("SGLang", "0.5.21", "0.5.24")

logger = logging.getLogger("sglang.atom_sglang")

_registered: list[str] | None = None


def plugin_disabled() -> bool:
    return env_flag(DISABLE_ENV)


def sglang_version() -> str:
    """The installed SGLang's version (its distribution's metadata; no import)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
        from sglang.version import __version__

        return __version__


# Through SGLang's logging once it is configured; to stderr before.
_say = PluginLog(logger, [logging.getLogger(), logging.getLogger("sglang")], "atom_sglang")


def served_architectures() -> list[str]:
    """Registry architectures for host "sglang" whose ATOM module and adapter exist."""
    from atom_sglang.adapters import has_adapter

    return hosts_plugin.served_architectures("sglang", has_adapter, logger)


def register_attention_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from atom_sglang.backend import create_atom_backend

    ATTENTION_BACKENDS[BACKEND_NAME] = create_atom_backend
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])


def register_models(archs: list[str]) -> None:
    from sglang.srt.models.registry import ModelRegistry

    from atom_sglang.model import wrapper_class

    for arch in archs:
        ModelRegistry.models[arch] = wrapper_class(arch)


def _refuse_requested_launches() -> None:
    from atom_sglang.guard import refuse_requested_launches

    try:
        # Late-bound: the installed version as it is at launch (tests fake it).
        refuse_requested_launches(SUPPORTED, lambda: sglang_version(), DISABLE_ENV, _say)
    except Exception:  # an SGLang without the resolution hooks: the log line must do
        _say("cannot check SGLang launches for ATOM requests", level=logging.DEBUG, exc_info=True)


def register() -> None:
    """The `sglang.srt.plugins` entry point: idempotent, and never raises into SGLang
    except `UnsupportedHostVersion` where the user requested ATOM on an SGLang outside
    `SUPPORTED` (SGLang's loader logs it; the launch raises it, `atom_sglang.guard`)."""
    global _registered
    if plugin_disabled():
        if _registered is None:
            _registered = []
            _say("%s=1: ATOM plugin inactive, SGLang runs its own models", DISABLE_ENV)
        return
    if _registered is not None:
        return
    version = sglang_version()
    if not SUPPORTED.admits(version):
        _registered = []
        _refuse_requested_launches()
        # One log line, or (ATOM requested) UnsupportedHostVersion for SGLang's loader to
        # log; the launch check just installed is what stops a requested launch.
        check_host_version(SUPPORTED, version, env_flag_off(DISABLE_ENV), _say)
        return
    try:
        from atom_sglang.patches import apply_patches

        archs = [] if env_flag(BACKEND_ONLY_ENV) else served_architectures()
        register_attention_backend()
        register_models(archs)
        patched = apply_patches(archs)
        _registered = archs
        _say(
            "ATOM %s serves %s in SGLang (attention backend %r%s)",
            __version__,
            ", ".join(archs) or "no architectures",
            BACKEND_NAME,
            f"; hooks: {', '.join(patched)}" if patched else "",
        )
    except Exception:  # never break SGLang: log and leave it as it was
        _registered = None
        _say(
            "atom_sglang.register() failed; SGLang runs its own models",
            level=logging.ERROR,
            exc_info=True,
        )


__all__ = [
    "SUPPORTED",
    "register",
    "served_architectures",
    "plugin_disabled",
    "sglang_version",
    "__version__",
]
