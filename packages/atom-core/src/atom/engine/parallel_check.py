"""Parallel settings that cannot run fail here, with one error, before any worker process
starts or any weight loads.

The shape constraints (heads, KV heads, linear-attention heads, intermediate sizes, expert
counts against the group sizes) are the layers' own: each layer divides its sizes when it
is built. So rather than restate them per family, the check builds the model's layers on
the meta device (no memory, no weights) as rank 0 of the planned groups, and turns the
first layer that refuses into the error. What no layer can know (visible GPUs, which
modes a model supports) is checked before that.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from atom.config import ConfigError, EngineConfig, ParallelConfig
from atom.distributed import SingleProcessGroup, get_tp_group, set_tp_group
from atom.engine.model_runner import default_dtype
from atom.expert_parallel import (
    ExpertParallel,
    ExpertParallelError,
    ReplicatedTokens,
    get_expert_parallel,
    set_expert_parallel,
)
from atom.layers.quantization import get_quant_config


class _PlannedRank(SingleProcessGroup):
    """Rank 0 of a group of the planned size; the layers only read its size to build."""

    def __init__(self, world_size: int):
        self.world_size = world_size


def describe(parallel: ParallelConfig) -> str:
    settings = [f"tensor_parallel_size={parallel.tensor_parallel_size}"]
    if parallel.data_parallel_size > 1:
        settings.append(f"data_parallel_size={parallel.data_parallel_size}")
    if parallel.enable_expert_parallel:
        settings.append("enable_expert_parallel")
    return ", ".join(settings)


def check_parallel(config: EngineConfig) -> None:
    parallel, model = config.parallel, config.model
    entry = model.entry
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(parallel, name) < 1:
            raise ConfigError(f"{name}={getattr(parallel, name)} must be at least 1")
    if config.device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if parallel.world_size > visible:
            raise ConfigError(
                f"{describe(parallel)} needs {parallel.world_size} GPUs; {visible} visible"
                " (CUDA_VISIBLE_DEVICES)"
            )
    if parallel.enable_expert_parallel and not entry.moe:
        raise ConfigError(
            f"enable_expert_parallel: {entry.architecture} is a dense model (no MoE experts)"
        )
    if parallel.all2all_backend == "all_to_all" and parallel.data_parallel_size == 1:
        raise ConfigError(
            "all2all_backend='all_to_all' needs data_parallel_size > 1: with tensor-parallel "
            "attention every rank holds every token, and nothing moves before the experts"
        )
    if parallel.data_parallel_size > 1:
        _check_data_parallel_attention(parallel, entry.architecture, entry.attention)
        if config.speculative is not None:
            raise ConfigError(
                f"data_parallel_size={parallel.data_parallel_size}: speculative decoding "
                "does not run with data-parallel attention yet"
            )
    if parallel.world_size > 1:
        _build_on_meta_as_rank_0(config)


def _check_data_parallel_attention(parallel: ParallelConfig, arch: str, attention: str) -> None:
    if attention != "MLA":
        raise ConfigError(
            f"data_parallel_size={parallel.data_parallel_size}: data-parallel attention is for "
            f"MLA models (DeepSeek-V2/V3 family); {arch} has {attention} attention"
        )
    if not parallel.enable_expert_parallel:
        raise ConfigError(
            f"data_parallel_size={parallel.data_parallel_size} needs enable_expert_parallel: "
            "the ranks' batches meet only in the expert-parallel MoE layers"
        )
    if parallel.tensor_parallel_size != 1:
        raise ConfigError(
            f"data_parallel_size={parallel.data_parallel_size} with tensor_parallel_size="
            f"{parallel.tensor_parallel_size}: data-parallel attention runs each rank's "
            "attention whole (tensor_parallel_size=1)"
        )


@contextmanager
def _as_rank_0(parallel: ParallelConfig):
    tp, ep = get_tp_group(), get_expert_parallel()
    set_tp_group(_PlannedRank(parallel.tensor_parallel_size))
    if parallel.enable_expert_parallel:
        group = _PlannedRank(parallel.world_size)
        set_expert_parallel(ExpertParallel(group, ReplicatedTokens(group)))
    try:
        yield
    finally:
        set_tp_group(tp)
        set_expert_parallel(ep)


def _build_on_meta_as_rank_0(config: EngineConfig) -> None:
    model = config.model
    model_cls = model.entry.load_class()
    quant_config = get_quant_config(model.hf_config)
    try:
        with _as_rank_0(config.parallel), torch.device("meta"), default_dtype(model.dtype):
            model_cls(model.hf_config, quant_config)
    except (ValueError, ExpertParallelError) as exc:
        raise ConfigError(
            f"{model.entry.architecture} cannot run with {describe(config.parallel)}: {exc}"
        ) from None
