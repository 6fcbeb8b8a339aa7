"""Configuration: the model (from a local HF folder), the KV cache, parallelism, the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from atom.registry import ModelEntry, get_entry, resolve_model_class

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# How data-parallel ranks' tokens reach the experts (vLLM's option of the same name):
# all-gather + reduce-scatter (atom.expert_parallel.GatheredTokens) or an all-to-all to the
# ranks of each token's experts only (atom.all_to_all_tokens).
ALL2ALL_BACKENDS = ("allgather_reducescatter", "all_to_all")
# kv_cache_dtype values: "auto" stores K/V in the model dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# mamba_ssm_cache_dtype values (vLLM's flag): what Gated DeltaNet layers store their
# recurrent state in; "auto" is the model dtype, as vLLM keeps it. The math is fp32.
SSM_CACHE_DTYPES = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16
}  # fmt: skip


class ConfigError(ValueError):
    """A config.json or engine setting that ATOM cannot run, with the reason."""


def parse_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """`rope_theta`, `rope_type` and scaling fields, from transformers 5 or 4.x configs."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_scaling_of(hf_config: Any) -> dict[str, Any] | None:
    """The scaling part of the rope parameters; None for plain rope."""
    params = get_rope_parameters(hf_config)
    if params["rope_type"] == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def _check_attention_shape(hf_config: Any) -> None:
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    hidden = getattr(hf_config, "hidden_size", None)
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        value = getattr(hf_config, name, None)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"config field {name}={value!r} must be a positive integer")
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}"
        )
    if getattr(hf_config, "head_dim", None) is None and hidden % heads:
        raise ConfigError(
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads} "
            "and the config gives no head_dim"
        )


@dataclass
class ModelConfig:
    """A model folder: its HF config, its ATOM registry entry and the run dtype."""

    path: str
    hf_config: Any
    entry: ModelEntry
    dtype: torch.dtype
    max_model_len: int

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
    ) -> ModelConfig:
        from transformers import AutoConfig

        folder = Path(path)
        config_file = folder / "config.json"
        if not folder.is_dir():
            raise ConfigError(f"model path {str(folder)!r} is not a directory")
        if not config_file.is_file():
            raise ConfigError(f"no config.json in {str(folder)!r}")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_file} is not valid JSON: {exc}") from None
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ConfigError(f"{config_file} names no 'architectures'")
        _, entry = resolve_model_class(architectures)
        try:
            checkpoint_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises several types for bad fields
            raise ConfigError(f"transformers cannot read {config_file}: {exc}") from exc
        # ATOM runs text models: a multimodal checkpoint's (Qwen3.5) is its text_config.
        hf_config = checkpoint_config.get_text_config()
        _check_attention_shape(hf_config)
        dtype_name = getattr(hf_config, "dtype", None) or getattr(checkpoint_config, "dtype", None)
        default_dtype = parse_dtype(
            str(dtype_name or "float32").replace("torch.", ""), torch.float32
        )
        limit = getattr(hf_config, "max_position_embeddings", None) or 4096
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len <= 0:
            raise ConfigError(f"max_model_len={max_model_len} must be positive")
        return cls(
            path=str(folder),
            hf_config=hf_config,
            entry=get_entry(entry.architecture),
            dtype=parse_dtype(dtype, default_dtype),
            max_model_len=max_model_len,
        )


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # a key of KV_CACHE_DTYPES
    mamba_ssm_cache_dtype: str = "auto"  # a key of SSM_CACHE_DTYPES
    # Sliding-window layers keep only their window's pages (atom.engine.kv_groups);
    # False: every layer keeps every page, as full attention does.
    window_only_kv: bool = True

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                f"{sorted(KV_CACHE_DTYPES)} ('auto': the model dtype)"
            )
        if self.mamba_ssm_cache_dtype not in SSM_CACHE_DTYPES:
            raise ConfigError(
                f"mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r} is not supported; use "
                f"one of {sorted(SSM_CACHE_DTYPES)} ('auto': the model dtype)"
            )

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache tensors are allocated in."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def ssm_dtype(self, model: ModelConfig) -> torch.dtype:
        """The dtype Gated DeltaNet layers keep their recurrent state in, "auto" resolved as
        vLLM does: the checkpoint's `mamba_ssm_dtype` (Qwen3.5 ships "float32"), else the
        model dtype."""
        chosen = SSM_CACHE_DTYPES[self.mamba_ssm_cache_dtype]
        named = getattr(model.hf_config, "mamba_ssm_dtype", None)
        if chosen is None and named is not None:
            if named not in SSM_CACHE_DTYPES:
                raise ConfigError(
                    f"config.json: mamba_ssm_dtype={named!r} is not one of "
                    f"{sorted(SSM_CACHE_DTYPES)}"
                )
            chosen = SSM_CACHE_DTYPES[named]
        return chosen or model.dtype


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # MoE experts split whole over all ranks instead of every expert's intermediate size
    # over the TP ranks (atom.expert_parallel); vLLM's flag of the same name.
    enable_expert_parallel: bool = False
    # Data-parallel attention for MLA models: each rank its own batch, MoE expert-parallel.
    data_parallel_size: int = 1
    all2all_backend: str = "allgather_reducescatter"  # one of ALL2ALL_BACKENDS

    def __post_init__(self):
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ConfigError(
                f"all2all_backend={self.all2all_backend!r} is not one of {list(ALL2ALL_BACKENDS)}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False  # no CUDA graphs (they are GPU-only anyway)
    # Tests: the steps CUDA graphs would replay run eagerly through the graphs' static,
    # padded inputs (StepGraphs' capture=False) on every rank: the CPU check of that path.
    static_graph_inputs: bool = False
    compile: bool = False  # torch.compile the sampler (atom/engine/compile.py)
    speculative: Any = None  # atom.speculative.config.SpeculativeConfig
    seed: int = 0  # of the random sampling of requests that give no seed of their own

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.startswith("cuda") and not self.enforce_eager
