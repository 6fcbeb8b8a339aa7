"""Config bridge: what ATOM needs from a `VllmConfig`, read once, nothing vLLM-typed kept.

ATOM model classes take `(hf_config, quant_config, prefix)`. vLLM already parsed the
checkpoint's `config.json` into a transformers config, so that object (a multimodal
checkpoint's text config, as vLLM's `hf_text_config` gives it) is handed over as is
(ATOM only reads it), except where vLLM's own config class for the model type leaves out
what ATOM reads (DeepSeek-V4: `transformers_config`); the dtype comes from vLLM's model config and the
quantization config is rebuilt by ATOM from the checkpoint's `quantization_config`.
Features ATOM's wrapper does not implement fail here, with the way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from atom.hosts.transformers_config import own_config_class
from atom.layers.quantization import QuantizationConfig, get_quant_config
from atom.registry import ModelEntry, get_entry
from atom_vllm.backend import FP8_CACHE_DTYPES, PLAIN_CACHE_DTYPES

# vLLM's own names for the checkpoint quantization formats ATOM loads itself (vLLM 0.32
# resolves an AWQ checkpoint to "awq" on CPU and "auto_awq" on GPUs, a GPTQ one to
# "auto_gptq"; the marlin names are the ones a user may pass as `quantization`).
_ATOM_QUANT_METHODS = {
    "fp8",
    "deepseek_v4_fp8",
    "compressed-tensors",
    "gpt_oss_mxfp4",
    "awq",
    "awq_marlin",
    "auto_awq",
    "gptq",
    "gptq_marlin",
    "auto_gptq",
}
# vLLM renames these methods inside the hf_config it hands over: the checkpoint's names
# (vLLM 0.32 routes GPT-OSS's MXFP4 and DeepSeek-V4's fp8 to methods of its own).
_CHECKPOINT_METHOD = {"gpt_oss_mxfp4": "mxfp4", "deepseek_v4_fp8": "fp8"}


class UnsupportedVllmFeature(NotImplementedError):
    """A vLLM setting the ATOM wrapper cannot honour (run with model_impl="vllm")."""


@dataclass(frozen=True)
class AtomRunConfig:
    """The ATOM side of one vLLM model instance."""

    entry: ModelEntry
    hf_config: Any  # transformers.PretrainedConfig, read-only: the text model's
    dtype: torch.dtype
    quant_config: QuantizationConfig | None
    tensor_parallel_size: int
    block_size: int
    model_impl: str


def model_impl_of(vllm_config: Any) -> str:
    """`model_config.model_impl` ("auto", "atom", "vllm", ...), lower-cased."""
    return str(getattr(vllm_config.model_config, "model_impl", "auto") or "auto").lower()


def vllm_own_reason(vllm_config: Any) -> str | None:
    """Why this run builds vLLM's own classes where ATOM's are registered (and ATOM's
    config hooks leave it alone), or None: ATOM's run."""
    if model_impl_of(vllm_config) == "vllm":
        return "model_impl='vllm'"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA (ATOM's layers take no adapters)"
    return None


def bridge(vllm_config: Any, architecture: str) -> AtomRunConfig:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    hf_config = model_config.hf_config
    entry = get_entry(architecture)

    def unsupported(what: str) -> UnsupportedVllmFeature:
        return UnsupportedVllmFeature(
            f"ATOM's {entry.architecture} in vLLM does not support {what}; "
            "run this model with vLLM's implementation (model_impl='vllm', "
            "--model-impl vllm) or set ATOM_DISABLE_VLLM_PLUGIN=1"
        )

    if parallel.pipeline_parallel_size > 1:
        raise unsupported(f"pipeline parallelism (pp={parallel.pipeline_parallel_size})")
    if parallel.enable_expert_parallel and parallel.data_parallel_size > 1:
        # vLLM's EP group then spans data-parallel ranks whose tokens differ.
        raise unsupported(
            f"expert parallelism across data-parallel ranks "
            f"(data_parallel_size={parallel.data_parallel_size})"
        )
    quantization = model_config.quantization
    if quantization is not None and quantization not in _ATOM_QUANT_METHODS:
        raise unsupported(f"quantization={quantization!r}")
    quant_config = get_quant_config(_with_checkpoint_method(hf_config))
    if quantization is not None and quant_config is None:
        raise unsupported(f"online quantization ({quantization!r} on an unquantized checkpoint)")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES:
        raise unsupported(f"kv_cache_dtype={cache_dtype!r}")

    return AtomRunConfig(
        entry=entry,
        # ATOM runs text models: a multimodal checkpoint's (Kimi-K2.5) is its text config.
        hf_config=transformers_config(model_config.hf_text_config),
        dtype=model_config.dtype,
        quant_config=quant_config,
        tensor_parallel_size=parallel.tensor_parallel_size,
        block_size=vllm_config.cache_config.block_size,
        model_impl=model_impl_of(vllm_config),
    )


def transformers_config(hf_config: Any) -> Any:
    """`hf_config`, or transformers' own config class rebuilt from it where vLLM parsed
    the checkpoint with a class of its own that leaves out what ATOM's model reads.

    vLLM 0.32 parses DeepSeek-V4 checkpoints with `vllm.transformers_utils.configs.
    DeepseekV4Config`, which keeps the config.json fields as they are (the release's
    names: `compress_ratios`, `num_hash_layers`, `rope_theta` / `compress_rope_theta`);
    transformers' `DeepseekV4Config` turns them into the `layer_types`, `mlp_layer_types`,
    `compress_rates` and per-type `rope_parameters` ATOM's model reads (and HF's model,
    the reference, reads). vLLM has registered its class with transformers' AutoConfig
    for the model type, so transformers' class is taken from its own name table
    (`atom.hosts.transformers_config`; patches.py, read 8).
    """
    own = own_config_class(hf_config)
    if own is None:
        return hf_config
    return own(**hf_config.to_dict())


def _with_checkpoint_method(hf_config: Any) -> Any:
    """`hf_config`, or a stand-in whose quantization_config names the method as the
    checkpoint does (for the methods vLLM renames), with DeepSeek-V4's top-level
    `expert_dtype` (which `get_quant_config` reads too)."""
    raw = getattr(hf_config, "quantization_config", None)
    if not isinstance(raw, dict) or raw.get("quant_method") not in _CHECKPOINT_METHOD:
        return hf_config
    method = _CHECKPOINT_METHOD[raw["quant_method"]]
    return SimpleNamespace(
        quantization_config={**raw, "quant_method": method},
        expert_dtype=getattr(hf_config, "expert_dtype", None),
    )
