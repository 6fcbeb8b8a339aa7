"""atom_vllm.patches: the vLLM names each patch relies on, and each patch in-process."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.config import MODELS_CONFIG_MAP

import atom_vllm


@pytest.mark.parametrize(
    ("model_impl", "max_num_seqs", "user_max", "expected"),
    [("auto", 1024, None, 1024), ("atom", 128, None, None), ("vllm", 1024, None, None),
     ("atom", 1024, 64, 64)],
)  # fmt: skip
def test_decode_graphs_cover_max_num_seqs_for_atom_models(
    fresh_plugin, checkpoints, model_impl, max_num_seqs, user_max, expected
):
    """Patch 1 runs inside vLLM's own config construction (on CPU vLLM captures no graphs,
    so the value stays as the hook left it)."""
    atom_vllm.register()
    compilation = {} if user_max is None else {"max_cudagraph_capture_size": user_max}
    engine_args = EngineArgs(
        model=str(checkpoints("Qwen3ForCausalLM")),
        skip_tokenizer_init=True,
        model_impl=model_impl,
        max_num_seqs=max_num_seqs,
        compilation_config=compilation,
    )
    vllm_config = engine_args.create_engine_config()
    assert vllm_config.compilation_config.max_cudagraph_capture_size == expected


def test_uncapturable_model_turns_cuda_graphs_off_in_its_engine_config(caplog):
    """A model with ATOM ops that cannot be captured sets its engine's cudagraph_mode to
    NONE (vLLM's runner reads it after building the model); nothing else changes."""
    from vllm.config import CUDAGraphMode, VllmConfig

    from atom_vllm.patches import cuda_graphs_off

    config = VllmConfig()
    # As vLLM resolves it on a GPU (its CPU platform resolves NONE).
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    cuda_graphs_off(config, "Qwen3MoeForCausalLM", ["fused_moe (torch)"])
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "not capturable: fused_moe (torch)" in caplog.text


@pytest.mark.parametrize(
    "name",
    [
        # Patch 1: the per-architecture config hook table and when vLLM reads it.
        "vllm.model_executor.models.config:MODELS_CONFIG_MAP",
        "vllm.model_executor.models.config:VerifyAndUpdateConfig.verify_and_update_config",
        "vllm.config:VllmConfig.try_verify_and_update_config",
        "vllm.config:VllmConfig._set_cudagraph_sizes",
        # Patch 2: where the runner reads the CUDA-graph mode after building the model.
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._check_and_update_cudagraph_mode",
        "vllm.config:CompilationConfig.resolve_cudagraph_mode_and_sizes",
        # The backend slot register() overrides.
        "vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM",
        # Patch 3: the hybrid hook that picks the mamba cache mode from prefix caching.
        "vllm.model_executor.models.config:HybridAttentionMambaModelConfig",
        "vllm.model_executor.models.config:MambaModelConfig.verify_and_update_config",
        # Patch 4: the layer's window, which decides its KV-cache spec.
        "vllm.model_executor.layers.attention:Attention.get_kv_cache_spec",
        # Read 6: vLLM's own model classes.
        "vllm.model_executor.models.registry:_VLLM_MODELS",
    ],
)
def test_vllm_names_the_patches_rely_on_exist(name):
    assert pkgutil.resolve_name(name) is not None


def test_config_hooks_keep_vllm_own_hook(fresh_plugin, monkeypatch):
    from atom_vllm.patches import install_config_hooks

    seen = []

    class VllmHook:
        @staticmethod
        def verify_and_update_config(vllm_config):
            seen.append(vllm_config)

    monkeypatch.setitem(MODELS_CONFIG_MAP, "LlamaForCausalLM", VllmHook)
    install_config_hooks(["LlamaForCausalLM"])
    install_config_hooks(["LlamaForCausalLM"])  # idempotent: wrapped once
    hook = MODELS_CONFIG_MAP["LlamaForCausalLM"]
    assert hook.atom_wrapped is VllmHook
    hook.verify_and_update_config(config := type("Cfg", (), {"model_config": None})())
    assert seen == [config]


# What atom-vllm reads, calls, overrides or inherits on vLLM objects beyond its imports (an
# import that breaks fails these modules' collection). Checked on vLLM 0.32.0 and, from the
# wheel's source, 0.33.0: docs/hosts/vllm-0.33.md.
VLLM_NAMES = [
    # backend.py: the backend, builder and impl contract.
    "vllm.v1.attention.backend:AttentionBackend.forward_includes_kv_cache_update",
    "vllm.v1.attention.backend:AttentionBackend.supported_dtypes",
    "vllm.v1.attention.backend:AttentionBackend.supported_kv_cache_dtypes",
    "vllm.v1.attention.backend:AttentionBackend.get_supported_kernel_block_sizes",
    "vllm.v1.attention.backend:AttentionBackend.supports_attn_type",
    "vllm.v1.attention.backend:AttentionBackend.supports_kv_cache_dtype",
    "vllm.v1.attention.backend:AttentionBackend.supports_sliding_window",
    "vllm.v1.attention.backend:AttentionBackend.supports_sink",
    "vllm.v1.attention.backend:AttentionBackend.is_mla",
    "vllm.v1.attention.backend:AttentionBackend.is_ssm",
    "vllm.v1.attention.backend:AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE",
    "vllm.v1.attention.backend:AttentionMetadataBuilder.reorder_batch_threshold",
    "vllm.v1.attention.backend:AttentionMetadataBuilder._cudagraph_support",
    "vllm.v1.attention.backend:AttentionMetadataBuilder._init_reorder_batch_threshold",
    "vllm.v1.attention.backend:AttentionType.DECODER",
    "vllm.v1.attention.backend:CommonAttentionMetadata.positions",
    "vllm.v1.attention.backend:CommonAttentionMetadata.compute_num_computed_tokens",
    "vllm.v1.kv_cache_interface:MambaSpec.num_speculative_blocks",
    # attention_layer.py, state_layer.py: ATOM's own layers of vLLM's layer kinds. vLLM 0.33
    # reads is_draft_layer on every layer when it builds the KV-cache specs.
    "vllm.model_executor.layers.attention:Attention.get_kv_cache_spec",
    "vllm.model_executor.layers.attention_layer_base:AttentionLayerBase.is_draft_layer",
    "vllm.model_executor.layers.mamba.abstract:MambaBase.bind_kv_cache",
    "vllm.model_executor.layers.mamba.abstract:MambaBase.get_kv_cache_spec",
    "vllm.v1.attention.backends.registry:MambaAttentionBackendEnum.GDN_ATTN",
    # model.py: the model interfaces vLLM inspects on the wrapper classes.
    "vllm.model_executor.models.interfaces:IsHybrid.get_mamba_state_shape_from_config",
    "vllm.model_executor.models.interfaces:IsHybrid.get_mamba_state_copy_funcs",
    "vllm.model_executor.models.interfaces:SupportsEagle3.set_aux_hidden_state_layers",
    "vllm.model_executor.models.interfaces:SupportsEagle3.get_eagle3_default_aux_hidden_state_layers",
    "vllm.model_executor.layers.mamba.mamba_utils:MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func",
    # mtp.py: the draft architectures vLLM's speculative config asks for (method "mtp").
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.model_returns_tuple",
    # step.py, distributed.py.
    "vllm.forward_context:ForwardContext.attn_metadata",
    "vllm.distributed.parallel_state:GroupCoordinator.all_reduce",
    "vllm.distributed.parallel_state:GroupCoordinator.all_gather",
    # config.py, patches.py, backend.py: the config fields read or set.
    "vllm.config:VllmConfig.lora_config",
    "vllm.config:VllmConfig.speculative_config",
    "vllm.config:VllmConfig.num_speculative_tokens",
    "vllm.config:ModelConfig.model_impl",
    "vllm.config:ModelConfig.hf_config",
    "vllm.config:ModelConfig.hf_text_config",
    "vllm.config:ModelConfig.quantization",
    "vllm.config:ModelConfig.architecture",
    "vllm.config:ParallelConfig.pipeline_parallel_size",
    "vllm.config:ParallelConfig.enable_expert_parallel",
    "vllm.config:CacheConfig.cache_dtype",
    "vllm.config:CacheConfig.block_size",
    "vllm.config:CacheConfig.enable_prefix_caching",
    "vllm.config:CacheConfig.mamba_cache_mode",
    "vllm.config:CacheConfig.mamba_cache_dtype",
    "vllm.config:CacheConfig.mamba_ssm_cache_dtype",
    "vllm.config:CompilationConfig.max_cudagraph_capture_size",
    "vllm.config:CompilationConfig.cudagraph_capture_sizes",
    "vllm.config:CompilationConfig.cudagraph_mode",
    "vllm.config:CompilationConfig.static_forward_context",
    "vllm.config:SchedulerConfig.max_num_batched_tokens",
    "vllm.config:SpeculativeConfig.draft_model_config",
    # Patch 2 under vLLM's model runner V2 (the default on GPUs): the model is built before
    # the runner resolves the CUDA-graph mode at KV-cache initialisation.
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.initialize_kv_cache",
]


def has_vllm_name(name: str) -> bool:
    """`module:Qualified.name` is an attribute or a dataclass field of vLLM's."""
    module, _, qualname = name.partition(":")
    *path, last = qualname.split(".")
    owner = importlib.import_module(module)
    for part in path:
        owner = getattr(owner, part)
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else ()
    return hasattr(owner, last) or last in fields


@pytest.mark.parametrize("name", VLLM_NAMES)
def test_vllm_names_atom_vllm_relies_on_exist(name):
    assert has_vllm_name(name), name


# The parameters atom-vllm passes by name, or takes in an override vLLM calls.
VLLM_PARAMETERS = {
    "vllm.model_executor.layers.attention:Attention.__init__": (
        "num_heads", "head_size", "scale", "num_kv_heads", "cache_config",
        "per_layer_sliding_window", "prefix", "attn_backend", "head_size_v"),
    "vllm.v1.attention.backend:AttentionImpl.forward": (
        "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
        "output_scale", "output_block_scale"),
    "vllm.v1.attention.backend:AttentionMetadataBuilder.__init__": (
        "kv_cache_spec", "layer_names", "vllm_config", "device"),
    "vllm.v1.attention.backend:AttentionMetadataBuilder.build": (
        "common_prefix_len", "common_attn_metadata", "fast_build"),
    "vllm.v1.attention.backends.utils:split_decodes_and_prefills": (
        "common_attn_metadata", "decode_threshold"),
    "vllm.v1.attention.backend:CommonAttentionMetadata": (
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
        "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping"),
    "vllm.v1.kv_cache_interface:MLAAttentionSpec": (
        "block_size", "num_kv_heads", "head_size", "dtype", "cache_dtype_str"),
    "vllm.utils.torch_utils:kv_cache_dtype_str_to_dtype": ("kv_cache_dtype", "model_config"),
}  # fmt: skip


@pytest.mark.parametrize("name", VLLM_PARAMETERS)
def test_vllm_parameters_atom_vllm_relies_on_exist(name):
    parameters = inspect.signature(pkgutil.resolve_name(name)).parameters
    assert set(VLLM_PARAMETERS[name]) <= set(parameters), name


def test_attention_impl_takes_vllm_positional_arguments():
    """vLLM's `Attention` builds the impl with ten positional arguments, in the order of
    `AttentionImpl.__init__`; ATOM's impl takes them in the same order."""
    from vllm.v1.attention.backend import AttentionImpl

    from atom_vllm.backend import AtomAttentionImpl

    vllm_order = list(inspect.signature(AttentionImpl.__init__).parameters)[1:]
    atom_order = list(inspect.signature(AtomAttentionImpl.__init__).parameters)[1:]
    assert atom_order[: len(vllm_order)] == vllm_order
