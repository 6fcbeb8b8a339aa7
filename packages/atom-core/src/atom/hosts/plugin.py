"""What every host plugin's registration needs: its switches, its log, the architectures
it serves, and the per-architecture wrapper classes its host looks up by name.

Plugins call this from their entry points, which hosts run in every process at start-up:
nothing here imports torch or a host.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from atom.registry import ModelEntry, all_models, get_entry


def env_flag(name: str) -> bool:
    """True when environment variable `name` is 1 / true / yes."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


class PluginLog:
    """Logs through `logger` once the host has configured logging (any of `configured`
    has handlers); before that, to stderr with the plugin's name and pid."""

    def __init__(self, logger: logging.Logger, configured: list[logging.Logger], tag: str):
        self.logger, self.configured, self.tag = logger, configured, tag

    def __call__(
        self, message: str, *args: object, level: int = logging.INFO, exc_info: bool = False
    ) -> None:
        if any(log.handlers for log in self.configured):
            self.logger.log(level, message, *args, exc_info=exc_info)
            return
        print(f"[{self.tag} pid={os.getpid()}] " + (message % args), file=sys.stderr)
        if exc_info:
            import traceback

            traceback.print_exc(file=sys.stderr)


def served_architectures(
    host: str, accepts: Callable[[ModelEntry], bool], logger: logging.Logger
) -> list[str]:
    """Registry architectures marked for `host` that the plugin `accepts` and whose ATOM
    module is installed."""
    archs = []
    for entry in all_models():
        if host not in entry.hosts or not accepts(entry):
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


def architecture_subclass(
    base: type, architecture: str, module: str, host: str, made: dict[str, Any]
) -> type:
    """The subclass of `base` named `architecture` (hosts key their registries by class
    name) with `atom_architecture` set; made once per architecture and kept in `made`."""
    cls = made.get(architecture)
    if cls is None:
        entry = get_entry(architecture)
        cls = type(
            architecture,
            (base,),
            {
                "atom_architecture": architecture,
                "__module__": module,
                "__qualname__": architecture,
                "__doc__": f"ATOM's {entry.family} ({entry.class_path}) as {host} model.",
            },
        )
        made[architecture] = cls
    return cls
