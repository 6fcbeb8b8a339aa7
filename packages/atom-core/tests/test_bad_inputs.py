"""Bad configs, checkpoints and requests fail with a message that names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom import LLM, SamplingParams
from atom.config import ConfigError, ModelConfig
from atom.loader import CheckpointError
from atom.registry import UnsupportedArchitectureError
from atom.sampling_params import SamplingParamsError
from tests.models.harness import write_checkpoint
from tests.models.test_llama import llama_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(llama_config(), tmp_path_factory.mktemp("llama"))


def copy_with(src, dst, config_edit=None, tensors_edit=None):
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(src / "model.safetensors"))
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        ModelConfig.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_unsupported_architecture_lists_supported(checkpoint, tmp_path):
    folder = copy_with(
        checkpoint, tmp_path / "m", lambda c: c.update(architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(folder)


def test_heads_not_divisible_by_kv_heads(checkpoint, tmp_path):
    folder = copy_with(checkpoint, tmp_path / "m", lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(
        ConfigError, match="num_attention_heads=4 is not divisible by num_key_value_heads=3"
    ):
        ModelConfig.from_pretrained(folder)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    folder = copy_with(
        checkpoint,
        tmp_path / "m",
        tensors_edit=lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
    )
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(model=str(folder), skip_tokenizer_init=True)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    folder = copy_with(checkpoint, tmp_path / "m", tensors_edit=shrink)
    with pytest.raises(
        CheckpointError, match="model.layers.0.self_attn.k_proj.weight.*too small|k_proj.*shape"
    ):
        LLM(model=str(folder), skip_tokenizer_init=True)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    folder = copy_with(
        checkpoint, tmp_path / "m", tensors_edit=lambda t: t.update(extra=torch.zeros(2))
    )
    with pytest.raises(CheckpointError, match="'extra' has no matching"):
        LLM(model=str(folder), skip_tokenizer_init=True)


def test_unsupported_dtype_and_quantization(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="unsupported dtype 'int3'"):
        ModelConfig.from_pretrained(checkpoint, dtype="int3")
    folder = copy_with(
        checkpoint, tmp_path / "m", lambda c: c.update(quantization_config={"quant_method": "hqq"})
    )
    with pytest.raises(ValueError, match="unsupported quantization method 'hqq'"):
        LLM(model=str(folder), skip_tokenizer_init=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must be"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts(checkpoint):
    llm = LLM(model=str(checkpoint), skip_tokenizer_init=True, max_model_len=32)
    with pytest.raises(ValueError, match="prompt has 40 tokens; max_model_len is 32"):
        llm.generate([[1] * 40], use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 256\)"):
        llm.generate([[1, 999]], use_tqdm=False)
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
