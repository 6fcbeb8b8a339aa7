"""Every change atom-sglang makes to SGLang's behaviour, every write into SGLang's state and
every private SGLang name it reads; each says why, what, where it was checked, and when it
can go (changes 1-4, writes and reads 5-8, changes 9-10 for DeepSeek Sparse Attention,
11-14 for DeepSeek-V4). Changes 2 and 3 go through SGLang's own
API for changing the resolved configuration after it was published
(`runtime_context.get_context().override`), with SGLang's own `with_phase` copy of the
CUDA-graph config; change 4 through its API for wrapping a step of argument resolution
(`register_resolution_hook`).

1. `support_triton` on the CPU engine (a hook through SGLang's own HookRegistry), SGLang
0.5.21 only. `sglang.srt.utils.common.support_triton(backend_name)` decides whether
SGLang's bookkeeping may launch Triton kernels (writing `req_to_token` in
`mem_cache/allocation.py`, ForwardBatch positions in `forward_batch_info.py`, mrope).
On 0.5.21 it decides from the attention backend's *name* alone: only "torch_native" and
"intel_amx" answer no. On SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) there is no
Triton driver, so `attention_backend="atom"` there fails at the first batch ("0 active
drivers"). What it changes: `support_triton("atom")` is False on the CPU engine, as it
is for torch_native; every other name and every GPU run is untouched. The hook is
registered only where SGLang's own answer for "atom" on the CPU engine is True (asked
at registration): 0.5.23's `support_triton` first asks the platform
(`current_platform.capabilities.supports_triton`, False for its CPU platform), so there
it already says no and no hook is registered. Checked on SGLang 0.5.17 and 0.5.21 (on
0.5.21 without it the first batch fails in `write_cache_indices`; the AROUND hook also
rebinds the modules that imported the function by name), and 0.5.23 (no hook; its CPU
engine end to end). Remove when: SGLang 0.5.21 leaves the supported range.

2. Prefill CUDA graphs off while an ATOM model serves (`keep_prefill_eager`).
On a GPU, SGLang captures prefill steps in CUDA graphs by default (breakable graphs,
`--cuda-graph-backend-prefill`): it takes the decoder body it finds by walking `.model`
down to the module with `.layers` and calls it as `forward(input_ids, positions,
forward_batch, **kw)` (`prefill_cuda_graph_runner.py`). ATOM's decoder bodies take
`(input_ids, positions)` and read the batch from ATOM's forward context, so the capture
fails ("LlamaModel.forward() takes 3 positional arguments but 5 were given", H200,
SGLang 0.5.17). What it changes: when ATOM's wrapper is built, the prefill phase of the
published CUDA-graph config becomes SGLang's own "disabled" (as
`--cuda-graph-backend-prefill disabled` would); decode graphs and SGLang's own models
are untouched. The model is built (`ModelRunner.initialize` -> `load_model`) before the
prefill graph runner reads the config. Checked on SGLang 0.5.17, 0.5.21 and 0.5.23
(0.5.23 still calls the decoder body so and keeps breakable prefill graphs the default
on CUDA; on other devices its default became "disabled"; checked in-process on CPU with a
config published as on a GPU, not yet on a GPU). Remove when: ATOM's decoder bodies take
SGLang's prefill-graph call, or SGLang asks the model.

3. Decode CUDA graphs up to 1024 requests while an ATOM model serves
(`capture_decode_batches_up_to`).
SGLang sizes its decode graphs from GPU memory (`arg_groups/memory_hook.py`: an H100 or
H200 with tp<4 gets decode max_bs 256) and runs larger decode batches eagerly. That
suits SGLang's own models (CUDA kernels), but an ATOM model run eagerly is CPU-bound
(Python and Triton launches): at 1,024 requests it fell behind SGLang alone, and came
out ahead with `cuda_graph_max_bs_decode=1024` (docs/performance.md, "2026-11-22,
earlier", H200, SGLang 0.5.17). What it changes: when
ATOM's wrapper is built with decode CUDA graphs on a GPU, and the user chose no decode
sizes (neither `--cuda-graph-max-bs[-decode]`, `--cuda-graph-bs[-decode]` nor a JSON
`cuda_graph_config` decode `max_bs`/`bs`, i.e. none in SGLang's
`_cuda_graph_config_locked`), the decode phase's `max_bs` becomes 1024 and its `bs` list
SGLang's own `generate_decode_cuda_graph_batch_sizes(server_args, 1024)`; the graph
runner still clamps that list to `req_to_token_pool.size` (`get_batch_sizes_to_capture`).
The model is built before the KV pools, the shared logits buffer and the decode graph
runner read the config, so they all see the new sizes. Not changed:
`mem_fraction_static`, computed from the old max_bs when the server args were resolved
(its graph reserve, max_bs * 2 MB, stays 1.5 GB below what `--cuda-graph-max-bs-decode
1024` would reserve). Checked on SGLang 0.5.17, 0.5.21 and 0.5.23 (on 0.5.21 and 0.5.23
in-process on CPU with a config published as on a GPU; not yet re-measured on a GPU). Remove when: SGLang
sizes decode graphs per model, or ATOM's eager decode is no longer CPU-bound.

4. The "atom" backend passes SGLang's attention-backend check for GPT-OSS
(`admit_atom_backend`, a resolution hook around `handle_model_specific_adjustments`).
For GptOssForCausalLM that step (`arg_groups/model_hook.py`) asserts that the prefill
and decode attention backends are among 'triton', 'trtllm_mha', 'fa3', 'fa4', 'ascend',
'intel_amx', 'intel_xpu' and 'aiter', SGLang's backends with attention sinks and sliding
windows. ATOM's backend has both, but is not on that list, so
`attention_backend="atom"` fails at launch ("GptOssForCausalLM requires one of [...]
attention backend"), on CPU and GPU alike. What it changes: for an architecture in
`SINKS_AND_WINDOW_ARCHITECTURES` that ATOM serves, the attention-backend fields that
resolve to "atom" are declared (SGLang's `declare_resolution`, how every step writes)
as "triton" while the step runs, and as "atom" again right after it. For
GptOssForCausalLM the step reads the backend names only for that check (its model
overrides choose a backend only where none is set), so everything else it does runs as
before: the model overrides (MoE runner, dtype), the MoE runner's ep_size check, the
hybrid-cache and all-reduce passes. Other backends, other models, and SGLang's own
GPT-OSS (the plugin in backend-only mode) keep the check. Checked on SGLang 0.5.21 and
0.5.23 (their CPU engines end to end; the step has no device-specific branch for this
check, and its list of backends is the same on both).
Remove when: SGLang's check asks the backend whether it has sinks and sliding windows.

5. Write: ATOM's backend and models into SGLang's registries (`atom_sglang.register`).
Why: SGLang's plugin entry point has no registration call; its registries are
module-level dicts. What: `ATTENTION_BACKENDS["atom"] = create_atom_backend` and
`ModelRegistry.models[arch] = <ATOM wrapper>` for every served architecture, plus the
"atom" choice through `add_attention_backend_choices` (SGLang's API). Checked on SGLang
0.5.21 and 0.5.23 (`attention_registry.ATTENTION_BACKENDS`, `models.registry.ModelRegistry.models`;
`test_register_serves_every_sglang_capable_architecture`). Remove when: SGLang offers
registration functions for plugins.

6. Write: a checkpoint's fp8 KV-cache scales into the `RadixAttention` of ATOM's layers
(`SglangAttention.k_scale` / `v_scale`). Why: SGLang's own backends read a layer's scales
from its `k_scale_float` / `v_scale_float` attributes, which SGLang's loader sets only for
its own models. What: the attributes, after construction, from `atom.loader`. Checked on
SGLang 0.5.21 and 0.5.23 (`RadixAttention.__init__` sets both to None). Remove when: RadixAttention
takes the scales as constructor arguments or a loader hook.

7. Read: SGLang's step through its forward context (`atom_sglang.model`, the bridge only).
Why: the model wrapper must know whether ATOM's backend runs the step (then it puts that
backend's metadata into ATOM's forward context) and binds ATOM's layers to the backend's
pools; SGLang hands a model only the ForwardBatch. What:
`sglang.srt.model_executor.forward_context.get_attn_backend` / `get_token_to_kv_pool`
(public), and the backend's `full_attn_backend` where SGLang's hybrid linear-attention
wrapper holds it. Checked on SGLang 0.5.21 and 0.5.23. Remove when: SGLang passes the backend's
metadata to the model's forward.

8. Read (private): `server_args._cuda_graph_config_locked` (change 3). Why: the only
record of which CUDA-graph sizes the user chose. What: read, never written. Checked on
SGLang 0.5.21 and 0.5.23 (`arg_groups/cuda_graph_hook.py` fills it). Remove when: SGLang exposes
the user's choices, or change 3 goes.

9. SGLang's DSA path off for the sparse-attention models ATOM serves (`not_sglang_dsa`, a
HookRegistry AROUND hook on `sglang.srt.configs.model_config.is_deepseek_dsa`).
Why: SGLang routes a checkpoint whose architecture is DeepSeek-V3.2 / GLM-5 (with
`index_topk`) through its own DSA machinery: argument resolution calls
`torch.cuda.get_device_capability()` on every platform but NPU and XPU (so its CPU
engine stops: "Torch not compiled with CUDA enabled"), sets page size 64, the "dsa"
backend and an fp8 KV cache, and the pool becomes a `DSATokenToKVPool` (fp8 latents,
bf16 rope, fp8 indexer keys with block scales), which only SGLang's DSA kernels read.
ATOM's model attends with ATOM's backend over SGLang's plain MLA pool, its indexer keys
in the same rows (change 10). What: `is_deepseek_dsa(config)` answers False for a
config whose first architecture ATOM serves; every other model, and every model while
the plugin is off or in backend-only mode, gets SGLang's answer. SGLang's HookRegistry
also rebinds the modules that imported the function by name. Checked on SGLang 0.5.21
and 0.5.23 (their CPU engines end to end, `test_sglang_sparse.py`; the DSA branches of
`arg_groups/model_hook.py`, `mem_cache/kv_cache_configurator.py` and
`model_executor/pool_configurator.py` all ask this function). Remove when: SGLang lets a
model declare its own KV layout, or ATOM's kernels read SGLang's DSA pool.

10. The MLA pool's rows hold ATOM's indexer keys (`rows_with_indexer_keys`, a
HookRegistry AFTER hook on `ModelConfig._derive_model_shapes`, a private method).
Why: ATOM keeps a sparse layer's indexer keys beside its latents, in the same pages and
slots (the indexer's selection is slots that sparse MLA reads as latent rows), as it
does natively and in vLLM; SGLang sizes its MLA pool rows, and its memory budget per
token, from `ModelConfig.kv_lora_rank + qk_rope_head_dim`. What: for a config whose
architecture ATOM serves and that has `index_topk`, `kv_lora_rank` grows by
`index_head_dim` after SGLang derived it, so each pool row holds latent + rope +
indexer key and SGLang counts those bytes; ATOM's layers split the row
(`SglangMLAAttention`). Only SGLang's own MLA backends would read `kv_lora_rank` as the
latent width, and ATOM's sparse layers refuse them. GLM-5's layers that reuse another
layer's selection leave the key columns unused (one pool width for every layer).
Checked on SGLang 0.5.21 and 0.5.23 (`_build_mla_kv_pool` and the cell size of
`pool_configurator.py` read only `kv_lora_rank` and `qk_rope_head_dim` for a non-DSA
MLA model). Remove when: SGLang's MLA pool takes a per-token width from the model.

11. SGLang's DeepSeek-V4 path off for ATOM's DeepSeek-V4 (`not_sglang_deepseek_v4`, a
HookRegistry AROUND hook on `sglang.srt.configs.model_config.is_deepseek_v4`).
Why: for a DeepSeek-V4 architecture SGLang builds its own compressed-attention machinery
(`DeepSeekV4TokenToKVPool`, its compress-state pool, the hybrid SWA pool sizing, its fp4
expert loading, the scheduler's V4 branches), which only SGLang's V4 kernels read. ATOM's
layers keep their pages in SGLang's plain MLA pool (change 12). What: `is_deepseek_v4`
answers False for a config whose first architecture ATOM serves, as change 9 does for
`is_deepseek_dsa`; the modules that imported it by name are rebound by the HookRegistry.
Checked on SGLang 0.5.21 and 0.5.23 (their CPU engines end to end,
`test_sglang_deepseek_v4.py`; `pool_configurator.py`, `kv_cache_configurator.py`,
`scheduler.py`, `model_loader/loader.py`, `dsa/utils.py` ask this function). Remove
when: SGLang lets a model declare its own KV layout.

12. DeepSeek-V4's packed rows in SGLang's MLA pool (`pool_rows_for_atom`, the AFTER hook
of change 10 on `ModelConfig._derive_model_shapes`, a private method).
Why: ATOM's DeepSeek-V4 layer keeps, per page, tensors of different shapes (K = V rows,
compressor rows, compressed entries); a host that holds one row per token holds them as
one row wide enough for a page of all of them (`atom.hosts.packed_pages`), and SGLang's
only per-layer, one-row-per-token pool is the MLA pool. SGLang's V4 branch of
`_derive_model_shapes` says MHA. What: for a DeepSeek-V4 config ATOM serves,
`attention_arch` becomes MLA and `kv_lora_rank + qk_rope_head_dim` the widest layer's
packed row at page size 1 (`atom.models.deepseek_v4.cache_layouts`; an upper bound for
every page size, since a page holds at least one entry per compressor), so SGLang
allocates and counts those bytes; ATOM's layer views its part of the row
(`SglangCompressedAttention`). SGLang then treats the model as MLA wherever it asks
`attention_arch` (the MLA pool, its MLA backends and MLA defaults); only its own MLA
backends would read the row as latent + rope, and ATOM's V4 layer refuses them. Checked on SGLang
0.5.21 and 0.5.23 (as change 10). Remove when: as change 10.

13. No hybrid SWA pool for ATOM's DeepSeek-V4 (`not_hybrid_swa`, a HookRegistry AROUND
hook on `sglang.srt.configs.model_config.is_hybrid_swa_model`).
Why: SGLang lists DeepSeek-V4 among its hybrid sliding-window architectures by name, so
its pool configurator would split the cache into a full and a sliding pool (of MHA shape)
for its own V4 layers. ATOM's V4 keeps every layer's pages in one MLA pool, the full
layout (docs/architecture.md, "DeepSeek-V4"); ATOM's backend has no hybrid SWA MLA pool.
What: the function answers False for DeepSeek-V4 while ATOM serves it; GPT-OSS and
every other hybrid model keep SGLang's answer (ATOM runs GPT-OSS on SGLang's SWA pool).
Checked on SGLang 0.5.21 and 0.5.23 (`ModelConfig._derive_hybrid_model` is its only
caller). Remove when: changes 11 and 12 go.

14. SGLang's DeepSeek-V4 server defaults off for ATOM's DeepSeek-V4
(`without_own_declarations` around `sglang.srt.arg_groups.overrides.
collect_model_override_declarations`, `skip_own_defaults` around
`sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults`, HookRegistry AROUND
hooks). Why: argument resolution gives a DeepSeek-V4 checkpoint SGLang's "dsv4" attention
backend and page size 256 (its model-override provider), a sliding pool ratio of 0.1, and
an fp8 KV cache, asserting fp8 or bf16 (its V4 defaults): all for SGLang's own V4 kernels.
ATOM's model runs on ATOM's backend (`attention_backend="atom"`, which the user names,
as for the sparse models) over a plain pool of the model's dtype (an fp8 one is refused:
its rows hold compressor projections). What: for DeepSeek-V4 while ATOM serves it, the
override provider's declarations are left out and the V4 defaults step does nothing;
SGLang's V4 validations (context parallelism, V4.1 features) still run, and so do other
architectures' declarations and steps. Checked on SGLang 0.5.21 and 0.5.23 (the model
step, `arg_groups/model_hook.py`, calls both; the kv-cache pass runs only from the
defaults step). Remove when: SGLang lets a plugin's model opt out of an architecture's
server defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from atom_sglang.guard import ATTENTION_FIELDS, BACKEND_NAME

SOURCE = "atom_sglang.patches"  # the provenance SGLang records with each override
SUPPORT_TRITON = "sglang.srt.utils.common.support_triton"
MODEL_STEP = "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments"  # change 4
# Change 4: the architectures whose model step demands a backend with attention sinks
# and sliding windows, and the name "atom" is declared as while that step runs (one of
# SGLang's backends with both, which the step accepts on every device).
SINKS_AND_WINDOW_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
SINKS_AND_WINDOW_STAND_IN = "triton"
IS_DEEPSEEK_DSA = "sglang.srt.configs.model_config.is_deepseek_dsa"  # change 9
MODEL_SHAPES = "sglang.srt.configs.model_config.ModelConfig._derive_model_shapes"  # 10, 12
IS_DEEPSEEK_V4 = "sglang.srt.configs.model_config.is_deepseek_v4"  # change 11
IS_HYBRID_SWA = "sglang.srt.configs.model_config.is_hybrid_swa_model"  # change 13
MODEL_DECLARATIONS = "sglang.srt.arg_groups.overrides.collect_model_override_declarations"
V4_DEFAULTS = "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults"  # 14
DEEPSEEK_V4 = "DeepseekV4ForCausalLM"


def first_architecture(config: Any) -> str | None:
    """The first `architectures` name of an HF config object or dict (SGLang passes both)."""
    names = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(config, dict):
        names = getattr(config, "architectures", None)
    return names[0] if names else None


def not_served_by_sglang(served: Iterable[str]) -> Callable[..., bool]:
    """Changes 9 and 11: SGLang's `is_deepseek_dsa` / `is_deepseek_v4` answering False
    for the architectures ATOM `served`."""
    served = frozenset(served)

    def is_sglangs(original, config) -> bool:
        return first_architecture(config) not in served and original(config)

    return is_sglangs


def indexer_key_width(config: Any) -> int:
    """Channels per token a sparse-attention config's indexer keys take (0: none)."""
    if getattr(config, "index_topk", None) is None:
        return 0
    return getattr(config, "index_head_dim", 0) or 0


def not_hybrid_swa(served: Iterable[str]) -> Callable[..., bool]:
    """Change 13: `is_hybrid_swa_model` answering False for ATOM's DeepSeek-V4."""
    atom_v4 = DEEPSEEK_V4 in frozenset(served)

    def is_hybrid_swa_model(original, architectures, *args, **kwargs) -> bool:
        if atom_v4 and architectures and architectures[0] == DEEPSEEK_V4:
            return False
        return original(architectures, *args, **kwargs)

    return is_hybrid_swa_model


def without_own_declarations(served: Iterable[str]) -> Callable[..., list]:
    """Change 14: no model-override declarations for ATOM's DeepSeek-V4."""
    atom_v4 = DEEPSEEK_V4 in frozenset(served)

    def collect(original, architecture, *args, **kwargs) -> list:
        if atom_v4 and architecture == DEEPSEEK_V4:
            return []
        return original(architecture, *args, **kwargs)

    return collect


def skip_own_defaults(served: Iterable[str]) -> Callable[..., None]:
    """Change 14: SGLang's DeepSeek-V4 defaults step doing nothing for ATOM's model."""
    atom_v4 = DEEPSEEK_V4 in frozenset(served)

    def apply_defaults(original, server_args, model_arch, *args, **kwargs) -> None:
        if atom_v4 and model_arch == DEEPSEEK_V4:
            return None
        return original(server_args, model_arch, *args, **kwargs)

    return apply_defaults


def packed_row_width(config: Any) -> int:
    """Change 12: channels per token of DeepSeek-V4's widest layer, packed at page size 1."""
    from atom.hosts.packed_pages import packed_row_width as width_at
    from atom.models.deepseek_v4 import cache_layouts
    from atom_sglang.config import transformers_config

    layouts = cache_layouts(transformers_config(config))
    return max(width_at(layout, 1) for layout in layouts)


def pool_rows_for_atom(served: Iterable[str]) -> Callable[..., None]:
    """Changes 10 and 12: SGLang's MLA rows as wide as an ATOM-served model keeps them."""
    from sglang.srt.configs.model_config import AttentionArch

    served = frozenset(served)

    def after_model_shapes(_result, model_config) -> None:
        architecture = first_architecture(model_config.hf_config)
        if architecture not in served:
            return
        text = model_config.hf_text_config
        if architecture == DEEPSEEK_V4:
            model_config.attention_arch = AttentionArch.MLA
            model_config.kv_lora_rank = packed_row_width(text) - model_config.qk_rope_head_dim
        elif width := indexer_key_width(text):
            model_config.kv_lora_rank = text.kv_lora_rank + width

    return after_model_shapes


def _support_triton_on_cpu(original, backend: str) -> bool:
    return False if backend == BACKEND_NAME else original(backend)


def apply_patches(served: Iterable[str]) -> list[str]:
    """Registers the hooks this process needs for the architectures ATOM `served`
    (SGLang applies the HookRegistry ones after its plugins ran, the resolution hook at
    launch); returns the patched targets."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.utils.common import is_cpu, support_triton

    patched = []
    admitted = SINKS_AND_WINDOW_ARCHITECTURES.intersection(served)
    if admitted:
        step_name = MODEL_STEP.rpartition(".")[2]  # resolution hooks are keyed by name
        register_resolution_hook(step_name)(admit_atom_backend(admitted))
        patched.append(MODEL_STEP)
    if is_cpu() and support_triton(BACKEND_NAME):  # by name (0.5.21), not by platform
        HookRegistry.register(SUPPORT_TRITON, _support_triton_on_cpu, HookType.AROUND)
        patched.append(SUPPORT_TRITON)
    if served:
        for target in (IS_DEEPSEEK_DSA, IS_DEEPSEEK_V4):
            HookRegistry.register(target, not_served_by_sglang(served), HookType.AROUND)
        HookRegistry.register(MODEL_SHAPES, pool_rows_for_atom(served), HookType.AFTER)
        patched += [IS_DEEPSEEK_DSA, IS_DEEPSEEK_V4, MODEL_SHAPES]
    if DEEPSEEK_V4 in served:
        for target, hook in (
            (IS_HYBRID_SWA, not_hybrid_swa),
            (MODEL_DECLARATIONS, without_own_declarations),
            (V4_DEFAULTS, skip_own_defaults),
        ):
            HookRegistry.register(target, hook(served), HookType.AROUND)
            patched.append(target)
    return patched


def _architecture(server_args: Any) -> str | None:
    """The model's architecture as SGLang's model step reads it (None: no HF config)."""
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view
    from sglang.srt.connector import ConnectorType
    from sglang.srt.utils.common import parse_connector_type

    if parse_connector_type(resolving_view(server_args).model_path) == ConnectorType.INSTANCE:
        return None
    return model_config_of(server_args).hf_config.architectures[0]


def admit_atom_backend(architectures: frozenset[str]) -> Callable[[Any, Callable], None]:
    """Change 4: the wrapper of SGLang's model step under which "atom" passes the
    step's sinks-and-sliding-window backend check for `architectures`."""

    def step(server_args: Any, previous: Callable[[Any], None]) -> None:
        from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

        view = resolving_view(server_args)
        fields = [f for f in ATTENTION_FIELDS if getattr(view, f) == BACKEND_NAME]
        if not fields or _architecture(server_args) not in architectures:
            previous(server_args)
            return
        declare_resolution(server_args, SOURCE, **dict.fromkeys(fields, SINKS_AND_WINDOW_STAND_IN))
        previous(server_args)
        # Back to "atom", unless the step itself decided a backend meanwhile.
        kept = [f for f in fields if getattr(view, f) == SINKS_AND_WINDOW_STAND_IN]
        declare_resolution(server_args, SOURCE, **dict.fromkeys(kept, BACKEND_NAME))

    return step


def _graph_config():
    """The CUDA-graph config this process published, or None (nothing published)."""
    from sglang.srt.runtime_context import get_exec

    try:
        return get_exec().graph.cuda_graph_config
    except ValueError:  # unit tests, or a process that builds a model unpublished
        return None


def _publish(config) -> None:
    from sglang.srt.runtime_context import get_context

    get_context().override(SOURCE, cuda_graph_config=config)


def keep_prefill_eager() -> bool:
    """Turns SGLang's prefill CUDA graphs off for this process; True if they were on."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    config = _graph_config()
    if config is None or config.prefill.backend == Backend.DISABLED:
        return False
    _publish(with_phase(config, Phase.PREFILL, backend=Backend.DISABLED))
    return True


def decode_graphs_enabled() -> bool:
    """Whether SGLang will capture decode steps in CUDA graphs in this process."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    config = _graph_config()
    return config is not None and config.decode.backend != Backend.DISABLED


def _user_sized_decode(server_args) -> bool:
    """Whether the user chose the decode graph sizes (flags or JSON cuda_graph_config)."""
    from sglang.srt.model_executor.cuda_graph_config import Phase

    locked = getattr(server_args, "_cuda_graph_config_locked", None) or set()
    return any((Phase.DECODE, key) in locked for key in ("max_bs", "bs"))


def capture_decode_batches_up_to(max_bs: int = 1024) -> bool:
    """Extends SGLang's decode CUDA graphs to batches of up to `max_bs` requests unless
    the user chose decode sizes; True if it changed something."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    from sglang.srt.model_executor.cuda_graph_config import Phase, with_phase
    from sglang.srt.runtime_context import get_device, get_server_args

    if not decode_graphs_enabled():
        return False
    config = _graph_config()
    server_args = get_server_args()
    # CPU graphs are sized by torch_compile_max_bs instead (SGLang's own CPU branch).
    if get_device().device == "cpu" or _user_sized_decode(server_args):
        return False
    if (config.decode.max_bs or 0) >= max_bs:
        return False
    sizes = generate_decode_cuda_graph_batch_sizes(server_args, max_bs)
    _publish(with_phase(config, Phase.DECODE, max_bs=max_bs, bs=list(sizes)))
    return True
