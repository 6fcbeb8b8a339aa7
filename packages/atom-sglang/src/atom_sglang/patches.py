"""The two changes atom-sglang makes to SGLang's behaviour; each says why, what, and where
it was checked.

1. `support_triton` on the CPU engine (a hook through SGLang's own HookRegistry).
`sglang.srt.utils.common.support_triton(backend_name)` (SGLang 0.5.17) decides from the
attention backend's *name* whether SGLang's bookkeeping may launch Triton kernels
(writing `req_to_token`, building ForwardBatch positions, mrope); only "torch_native"
and "intel_amx" answer no. On SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) there is no
Triton driver, so `attention_backend="atom"` there fails at the first batch ("0 active
drivers"). What it changes: `support_triton("atom")` is False on the CPU engine, as it
is for torch_native; every other name and every GPU run is untouched. Checked on SGLang
0.5.17 (the AROUND hook also rebinds the modules that imported the function by name).

2. Prefill CUDA graphs off while an ATOM model serves (`keep_prefill_eager`).
On a GPU, SGLang 0.5.17 captures prefill steps in CUDA graphs by default (breakable
graphs, `--cuda-graph-backend-prefill`): it takes the decoder body it finds by walking
`.model` and calls it as `forward(input_ids, positions, forward_batch, input_embeds)`.
ATOM's decoder bodies take `(input_ids, positions)` and read the batch from ATOM's
forward context, so the capture fails ("LlamaModel.forward() takes 3 positional
arguments but 5 were given", H200, 2026-11-21). What it changes: when ATOM's wrapper is
built, the prefill phase of the server's CUDA-graph config is set to SGLang's own
"disabled" (as `--cuda-graph-backend-prefill disabled` would); decode graphs and SGLang's
own models are untouched. Checked on SGLang 0.5.17.
"""

from __future__ import annotations

import contextlib

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


def keep_prefill_eager() -> bool:
    """Turns SGLang's prefill CUDA graphs off for this process; True if they were on."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.server_args import get_global_server_args

    configs = []
    # The published config bags snapshot the server args: change whichever exist.
    with contextlib.suppress(Exception):
        configs.append(get_global_server_args().cuda_graph_config)
    with contextlib.suppress(ValueError, AttributeError):
        configs.append(get_exec().graph.cuda_graph_config)
    changed = False
    for config in configs:
        if config is not None and config.prefill.backend != Backend.DISABLED:
            config.prefill.backend = Backend.DISABLED
            changed = True
    return changed
