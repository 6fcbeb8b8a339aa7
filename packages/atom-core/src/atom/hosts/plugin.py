"""What every host plugin's registration needs: its switches, its log, the architectures
it serves, and the per-architecture wrapper classes its host looks up by name.

Plugins call this from their entry points, which hosts run in every process at start-up:
nothing here imports torch or a host.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atom.registry import ModelEntry, all_models, get_entry

TRY_UNTESTED_HOST_ENV = "ATOM_TRY_UNTESTED_HOST"


def env_flag(name: str) -> bool:
    """True when environment variable `name` is 1 / true / yes."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def env_flag_off(name: str) -> bool:
    """True when environment variable `name` is set to 0 / false / no (explicitly off)."""
    return os.environ.get(name, "").strip().lower() in ("0", "false", "no")


class UnsupportedHostVersion(RuntimeError):
    """ATOM was asked for explicitly on a host version outside the tested range."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.32.0+cpu" -> (0, 32, 0)."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(part):  # "0rc1": a pre-release of 0
            break
    return tuple(parts)


@dataclass(frozen=True)
class HostRange:
    """The host versions a plugin was tested on: `minimum` <= version < `below`."""

    host: str  # as users name it: "vLLM", "SGLang"
    minimum: str
    below: str

    def __str__(self) -> str:
        return f">={self.minimum},<{self.below}"

    def admits(self, version: str) -> bool:
        return release(self.minimum) <= release(version) < release(self.below)

    def refusal(self, version: str) -> str:
        return (
            f"{self.host} {version} is outside the range atom-{self.host.lower()} was tested "
            f"on ({self.host} {self})"
        )


def check_host_version(
    supported: HostRange, version: str, requested: bool, say: Callable[..., None]
) -> bool:
    """True when `version` is in the tested range. Outside it, a user who `requested` ATOM
    explicitly gets `UnsupportedHostVersion`; anyone else one log line, and False. With
    TRY_UNTESTED_HOST_ENV set (the newest-host check: `nox -s newest_hosts`), ATOM runs
    outside the range too, after one warning line."""
    if supported.admits(version):
        return True
    refusal = supported.refusal(version)
    if env_flag(TRY_UNTESTED_HOST_ENV):
        say("%s: ATOM runs on it (%s=1)", refusal, TRY_UNTESTED_HOST_ENV, level=logging.WARNING)
        return True
    if requested:
        raise UnsupportedHostVersion(
            f"{refusal}: ATOM was requested but cannot run on it; install "
            f"{supported.host.lower()}{supported} or unset the request"
        )
    say("%s: ATOM inactive, the host runs its own models", refusal, level=logging.WARNING)
    return False


class PluginLog:
    """Logs through `logger` once the host has configured logging; before that, to
    stderr with the plugin's name and pid.

    Configured: one of `configured` has handlers, and the message's level passes, or
    is filtered by a level set on one of the host's own (non-root) `configured` loggers.
    A bare `logging.basicConfig()` that a host module runs at import (SGLang's does)
    leaves the root at its default WARNING: that is no one's choice, and INFO lines
    such as "ATOM serves ..." would vanish, so they go to stderr then."""

    def __init__(self, logger: logging.Logger, configured: list[logging.Logger], tag: str):
        self.logger, self.configured, self.tag = logger, configured, tag

    def host_logs(self, level: int) -> bool:
        if not any(log.handlers for log in self.configured):
            return False
        if self.logger.isEnabledFor(level):
            return True
        root = logging.getLogger()
        return any(log.level != logging.NOTSET for log in self.configured if log is not root)

    def __call__(
        self, message: str, *args: object, level: int = logging.INFO, exc_info: bool = False
    ) -> None:
        if self.host_logs(level):
            self.logger.log(level, message, *args, exc_info=exc_info)
            return
        print(f"[{self.tag} pid={os.getpid()}] " + (message % args), file=sys.stderr)
        if exc_info:
            import traceback

            traceback.print_exc(file=sys.stderr)


def served_architectures(
    host: str, accepts: Callable[[ModelEntry], bool], logger: logging.Logger
) -> list[str]:
    """Registry architectures marked for `host` (with their aliases) that the plugin
    `accepts` and whose ATOM module is installed."""
    archs = []
    for entry in all_models():
        if host not in entry.hosts or not accepts(entry):
            continue
        try:
            available = importlib.util.find_spec(entry.module) is not None
        except (ImportError, ValueError):
            available = False
        if available:
            archs.extend(entry.names)
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
