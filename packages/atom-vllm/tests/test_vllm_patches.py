"""atom_vllm.patches: the vLLM names each patch relies on, and each patch in-process."""

from __future__ import annotations

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
