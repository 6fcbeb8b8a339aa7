"""Where an explicit request for ATOM meets an SGLang outside the tested range.

SGLang runs plugins (`sglang.srt.plugins.load_plugins`) before it parses its arguments,
and logs and swallows any exception a plugin raises: `register()` cannot see
`--attention-backend atom` / `Engine(attention_backend="atom")`, and an error raised there
would not stop SGLang. So on an unsupported version `register()` installs one wrapper
around a step of SGLang's argument resolution (`register_resolution_hook`, SGLang's
plugin API for it), which raises `UnsupportedHostVersion` when ATOM was requested: in
the process that resolves the arguments (`Engine(...)`, `sglang serve`,
`python -m sglang.launch_server`), before a model is loaded or a scheduler started. The
name "atom" becomes an accepted `--attention-backend` choice, so that the command line
reaches that check instead of failing argparse with "invalid choice".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from atom.hosts.plugin import HostRange, check_host_version, env_flag_off

BACKEND_NAME = "atom"
# An early validation step, before model paths are resolved or weights downloaded; it
# is where SGLang itself rejects an explicitly requested runtime it cannot run.
RESOLUTION_STEP = "handle_hardware_runtime_validation"
ATTENTION_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")

_installed = False


def backend_requested(server_args: Any) -> bool:
    """Whether the user's arguments name ATOM's attention backend."""
    return any(getattr(server_args, name, None) == BACKEND_NAME for name in ATTENTION_FIELDS)


def refuse_requested_launches(
    supported: HostRange,
    version: Callable[[], str],
    disable_env: str,
    say: Callable[..., None],
) -> bool:
    """Makes SGLang's argument resolution raise `UnsupportedHostVersion` for a launch
    that requests ATOM (`disable_env`=0 or the "atom" backend) while `version()` is
    outside `supported`; True if installed (once per process)."""
    global _installed
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    def refuse_unsupported(server_args: Any, previous: Callable[[Any], None]) -> None:
        # Read at launch, not at registration: an in-range version lets everything pass.
        if env_flag_off(disable_env) or backend_requested(server_args):
            check_host_version(supported, version(), True, say)
        previous(server_args)

    if _installed:
        return False
    register_resolution_hook(RESOLUTION_STEP)(refuse_unsupported)
    _installed = True
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    return True
