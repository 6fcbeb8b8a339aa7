"""Parallel settings that cannot run fail with one ConfigError naming the setting, before
any worker process starts or any weight loads."""

from __future__ import annotations

import pytest
import torch

import atom.engine.llm_engine
from atom import LLM
from atom.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig
from atom.engine.parallel_check import check_parallel
from atom.testing import tiny_config
from tests.models.harness import write_checkpoint
from tests.models.test_deepseek import v2_config
from tests.models.test_llama import qwen3_config
from tests.models.test_moe_models import qwen3_moe_config


@pytest.fixture(autouse=True)
def no_engine_starts(monkeypatch):
    def refuse(config):
        raise AssertionError("the executor started: the check came too late")

    monkeypatch.setattr(atom.engine.llm_engine, "Executor", refuse)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    configs = {
        "dense": qwen3_config(),  # 4 heads, 2 KV heads
        "dense-6-heads": tiny_config(
            "Qwen3ForCausalLM",
            hidden_size=96,
            head_dim=16,
            num_attention_heads=6,
            num_key_value_heads=2,
            vocab_size=256,
        ),  # fmt: skip
        "moe-6-experts": qwen3_moe_config(num_experts=6),
        "mla": v2_config(),
    }
    return {
        name: str(write_checkpoint(c, tmp_path_factory.mktemp(name))) for name, c in configs.items()
    }


BAD_SETTINGS = {
    "heads": ("dense", dict(tensor_parallel_size=3), r"num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    "kv-heads": ("dense-6-heads", dict(tensor_parallel_size=3), r"num_key_value_heads=2 does not divide tensor_parallel_size=3"),
    "experts": ("moe-6-experts", dict(tensor_parallel_size=4, enable_expert_parallel=True), r"num_experts=6 is not divisible by the expert-parallel size 4"),
    "ep-on-dense": ("dense", dict(tensor_parallel_size=2, enable_expert_parallel=True), r"enable_expert_parallel: Qwen3ForCausalLM is a dense model"),
    "dp-without-mla": ("moe-6-experts", dict(data_parallel_size=2, enable_expert_parallel=True), r"data-parallel attention is for MLA models .* Qwen3MoeForCausalLM has MHA"),
    "dp-without-ep": ("mla", dict(data_parallel_size=2), r"data_parallel_size=2 needs enable_expert_parallel"),
    "dp-with-tp": ("mla", dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True), r"runs each rank's attention whole"),
    "dp-experts": ("mla", dict(data_parallel_size=3, enable_expert_parallel=True), r"is not divisible by the expert-parallel size 3"),
    "zero-ranks": ("dense", dict(tensor_parallel_size=0), r"tensor_parallel_size=0 must be at least 1"),
    "all2all-backend": ("mla", dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="deepep"), r"all2all_backend='deepep' is not one of \['allgather_reducescatter', 'all_to_all'\]"),
    "all-to-all-without-dp": ("moe-6-experts", dict(tensor_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all"), r"all2all_backend='all_to_all' needs data_parallel_size > 1"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_SETTINGS))
def test_bad_parallel_setting_is_one_clear_error(checkpoints, name):
    model, settings, message = BAD_SETTINGS[name]
    with pytest.raises(ConfigError, match=message):
        LLM(checkpoints[model], skip_tokenizer_init=True, **settings)


VALID_SETTINGS = {
    "dp-attention": ("mla", dict(data_parallel_size=2, enable_expert_parallel=True)),
    "dp-attention-all-to-all": (
        "mla",
        dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all"),
    ),
    "ep-with-tp": ("moe-6-experts", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
}


@pytest.mark.parametrize("name", list(VALID_SETTINGS))
def test_valid_parallel_setting_reaches_the_executor(checkpoints, name):
    model, settings = VALID_SETTINGS[name]
    with pytest.raises(AssertionError, match="the executor started"):
        LLM(checkpoints[model], skip_tokenizer_init=True, **settings)


def test_more_data_parallel_gpus_than_visible(checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"data_parallel_size=2, enable_expert_parallel needs 2"):
        LLM(
            checkpoints["mla"],
            device="cuda",
            skip_tokenizer_init=True,
            data_parallel_size=2,
            enable_expert_parallel=True,
        )


def test_data_parallel_attention_refuses_speculative_decoding(checkpoints):
    config = EngineConfig(
        ModelConfig.from_pretrained(checkpoints["mla"]),
        parallel=ParallelConfig(enable_expert_parallel=True, data_parallel_size=2),
        speculative=object(),  # any method: the check reads only that one is set
    )
    with pytest.raises(ConfigError, match="speculative decoding does not run with data-par"):
        check_parallel(config)


def test_more_gpus_than_visible(checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs 2 GPUs; 1 visible"):
        LLM(checkpoints["dense"], device="cuda", skip_tokenizer_init=True, tensor_parallel_size=2)
