"""The one patch atom-sglang makes to SGLang, applied through SGLang's own HookRegistry.

`sglang.srt.utils.common.support_triton(backend_name)` (SGLang 0.5.17) decides from the
attention backend's *name* whether SGLang's bookkeeping may launch Triton kernels
(writing `req_to_token`, building ForwardBatch positions, mrope); only "torch_native"
and "intel_amx" answer no. On SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) there is no
Triton driver, so `attention_backend="atom"` there fails at the first batch ("0 active
drivers"). What it changes: `support_triton("atom")` is False on the CPU engine, as it
is for torch_native; every other name and every GPU run is untouched. Checked on SGLang
0.5.17 (the AROUND hook also rebinds the modules that imported the function by name).
"""

from __future__ import annotations

BACKEND_NAME = "atom"
SUPPORT_TRITON = "sglang.srt.utils.common.support_triton"


def _support_triton_on_cpu(original, backend: str) -> bool:
    return False if backend == BACKEND_NAME else original(backend)


def apply_patches() -> list[str]:
    """Registers the hooks this process needs (SGLang applies them after its plugins
    ran); returns the patched targets."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils.common import is_cpu

    if not is_cpu():
        return []
    HookRegistry.register(SUPPORT_TRITON, _support_triton_on_cpu, HookType.AROUND)
    return [SUPPORT_TRITON]
