"""`atom bench --quantize`: the bench's random checkpoints rewritten shard by shard as the
quantizers store them, checked against the test packers' single-file twins."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from atom import LLM, SamplingParams
from atom.bench.quantize import quantize_checkpoint
from atom.bench.run import resolve
from atom.bench.traffic import bytes_moved
from atom.bench.workloads import BenchError
from atom.testing import tiny_config
from atom.testing.mxfp4 import write_mxfp4_pair
from atom.testing.w4a16 import Scheme, write_w4a16_pair
from tests.models.harness import make_prompts, write_checkpoint
from tests.test_bench import _args

QWEN3 = dict(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2)
GPT_OSS = dict(vocab_size=256, hidden_size=64, intermediate_size=64)


def greedy(folder, prompts) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", device="cpu", skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def sharded(config, folder):
    """The random checkpoint twice: one file (the packers' input) and 300 kB shards (as
    `save_pretrained` splits a bench checkpoint)."""
    single = write_checkpoint(config, folder / "single", init_std=0.1)
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(folder / "shards", max_shard_size="300KB")
    (folder / "shards" / "config.json").write_text((single / "config.json").read_text())
    assert len(list((folder / "shards").glob("*.safetensors"))) > 2
    return single, folder / "shards"


@pytest.mark.parametrize("method", ["gptq", "awq", "mxfp4"])
def test_sharded_checkpoint_quantized_in_place_equals_the_packers_twin(tmp_path, method):
    architecture = "GptOssForCausalLM" if method == "mxfp4" else "Qwen3ForCausalLM"
    config = tiny_config(architecture, **(GPT_OSS if method == "mxfp4" else QWEN3))
    single, shards = sharded(config, tmp_path)
    quantize_checkpoint(shards, method)
    if method == "mxfp4":
        twin, _ = write_mxfp4_pair(single, tmp_path / "twin")
    else:
        twin, _ = write_w4a16_pair(single, tmp_path / "twin", Scheme(method, 128, method == "gptq"))
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    stored = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(shards / file, "pt") as f:
            names = f.keys()  # safe_open is not iterable
            stored |= {name: (file, f.get_tensor(name)) for name in names}
    assert {n: f for n, (f, _) in stored.items()} == index["weight_map"]
    with safe_open(twin / "model.safetensors", "pt") as f:
        names = f.keys()
        assert set(names) == set(stored)
        for name in names:
            torch.testing.assert_close(stored[name][1], f.get_tensor(name), rtol=0, atol=0)
    config_of = {p: json.loads((p / "config.json").read_text()) for p in (shards, twin)}
    assert config_of[shards]["quantization_config"] == config_of[twin]["quantization_config"]
    prompts = make_prompts(256, [5, 17], seed=3)
    assert greedy(shards, prompts) == greedy(twin, prompts)


def test_quantize_option_names_shapes_and_rejects_mxfp4_without_gpt_oss():
    args = _args(["--engines", "atom", "--shapes", "qwen3-8b:8", "--quantize", "gptq"])
    resolve(args)
    (shape,) = args.shape_list
    assert shape.name == "qwen3-8b:8+gptq" and shape.quantization == "gptq"
    # The traffic model counts bf16 weights: a quantized run reports no GB/s.
    assert bytes_moved(shape, args.workload_list[0], 2) is None
    with pytest.raises(BenchError, match="mxfp4 quantizes GPT-OSS experts; not Qwen3ForCausalLM"):
        resolve(_args(["--engines", "atom", "--shapes", "qwen3-8b", "--quantize", "mxfp4"]))
