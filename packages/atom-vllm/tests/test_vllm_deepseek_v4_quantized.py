"""A DeepSeek-V4 checkpoint quantized as the releases store it reaches ATOM's loader
through vLLM's config (the model's numbers: atom-core's test_deepseek_v4_quantized.py).

vLLM 0.32 routes DeepSeek-V4's `quant_method: "fp8"` to a method of its own,
`deepseek_v4_fp8`, in its ModelConfig and inside the hf_config it hands over, and keeps
the release's `expert_dtype` at the config's top level.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import ModelConfig

from atom.layers.quantization.fp8 import Fp8Config
from atom.testing import write_host_checkpoint
from atom.testing.deepseek_v4_quant import write_release_quantized_pair
from atom_vllm.config import bridge

ARCH = "DeepseekV4ForCausalLM"


def test_vllms_deepseek_v4_fp8_is_atoms_fp8_with_fp4_experts(tmp_path):
    source = write_host_checkpoint(ARCH, tmp_path / "source")
    quantized, _ = write_release_quantized_pair(source, tmp_path, "fp4")
    # vLLM runs its deepseek_v4_fp8 method in 16-bit dtypes only.
    model_config = ModelConfig(model=str(quantized), dtype="bfloat16", skip_tokenizer_init=True)
    assert model_config.quantization == "deepseek_v4_fp8"
    vllm_config = SimpleNamespace(
        model_config=model_config,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, enable_expert_parallel=False, data_parallel_size=1,
            tensor_parallel_size=1,
        ),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=256),
    )  # fmt: skip
    quant_config = bridge(vllm_config, ARCH).quant_config
    assert isinstance(quant_config, Fp8Config)
    assert (quant_config.block_size, quant_config.expert_dtype) == ((128, 128), "fp4")
