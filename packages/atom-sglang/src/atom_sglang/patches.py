"""The three changes atom-sglang makes to SGLang's behaviour; each says why, what, and where
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

3. Decode CUDA graphs up to 1024 requests while an ATOM model serves
(`capture_decode_batches_up_to`).
SGLang 0.5.17 sizes its decode graphs from GPU memory (`_handle_gpu_memory_settings`:
an H200 with tp<4 gets decode max_bs 256) and runs larger decode batches eagerly. That
suits SGLang's own models (CUDA kernels), but an ATOM model run eagerly is CPU-bound
(Python and Triton launches): on an H200 (Qwen3-0.6B shape, 1024 requests x 512 in ->
256 out) SGLang+ATOM did 24,205 output tok/s against SGLang alone 30,047 (0.81x), and
33,316 (1.11x) with `cuda_graph_max_bs_decode=1024`. What it changes: when ATOM's
wrapper is built with CUDA graphs on, and the user chose no decode sizes (neither
`--cuda-graph-max-bs[-decode]`, `--cuda-graph-bs[-decode]` nor a JSON
`cuda_graph_config` decode `max_bs`/`bs`, i.e. none in SGLang's
`_cuda_graph_config_locked`), the decode phase's `max_bs` becomes 1024 and its `bs` list
SGLang's own `_generate_decode_cuda_graph_batch_sizes(1024)`; the graph runner still
clamps that list to `req_to_token_pool.size` (`get_batch_sizes_to_capture`). The model
is built (`ModelRunner.initialize` -> `load_model`) before the KV pools, the shared
logits buffer (`max_decode_logits_rows`) and the decode graph runner read these fields,
so they all see the new sizes. Not changed: `mem_fraction_static`, computed from the old
max_bs when the server args were resolved (its graph reserve, max_bs * 2 MB, stays 1.5
GB below what `--cuda-graph-max-bs-decode 1024` would reserve). Checked on SGLang 0.5.17.
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


def _published_graph_configs() -> list:
    """The CUDA-graph configs this process published (server args, exec bag)."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.server_args import get_global_server_args

    configs = []
    # The published config bags snapshot the server args: change whichever exist.
    with contextlib.suppress(Exception):
        configs.append(get_global_server_args().cuda_graph_config)
    with contextlib.suppress(ValueError, AttributeError):
        configs.append(get_exec().graph.cuda_graph_config)
    unique = []
    for config in configs:
        if config is not None and all(config is not seen for seen in unique):
            unique.append(config)
    return unique


def keep_prefill_eager() -> bool:
    """Turns SGLang's prefill CUDA graphs off for this process; True if they were on."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    changed = False
    for config in _published_graph_configs():
        if config.prefill.backend != Backend.DISABLED:
            config.prefill.backend = Backend.DISABLED
            changed = True
    return changed


def _user_sized_decode(args) -> bool:
    """Whether the user chose the decode graph sizes (flags or JSON cuda_graph_config)."""
    from sglang.srt.model_executor.cuda_graph_config import Phase

    locked = getattr(args, "_cuda_graph_config_locked", None)
    if locked is not None:
        return any((Phase.DECODE, key) in locked for key in ("max_bs", "bs"))
    return (
        getattr(args, "cuda_graph_max_bs_decode", None) is not None
        or getattr(args, "cuda_graph_bs_decode", None) is not None
    )


def capture_decode_batches_up_to(max_bs: int = 1024) -> bool:
    """Extends SGLang's decode CUDA graphs to batches of up to `max_bs` requests unless
    the user chose decode sizes; True if it changed something."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.server_args import get_global_server_args

    try:
        args = get_global_server_args()
    except Exception:  # nothing published in this process (unit tests)
        return False
    # CPU graphs are sized by torch_compile_max_bs instead (SGLang's own CPU branch).
    if args is None or args.device == "cpu" or _user_sized_decode(args):
        return False
    sizes = args._generate_decode_cuda_graph_batch_sizes(max_bs)
    changed = False
    for config in _published_graph_configs():
        decode = config.decode
        if decode.backend == Backend.DISABLED or (decode.max_bs or 0) >= max_bs:
            continue
        decode.max_bs = max_bs
        decode.bs = list(sizes)
        changed = True
    return changed
