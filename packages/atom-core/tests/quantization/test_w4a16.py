"""4-bit weight-only checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) against HF
transformers running the weights they stand for.

The test quantizes a random Llama / Qwen3 checkpoint itself (`atom.testing.w4a16`, packers
written apart from ATOM's loaders) and writes the dequantized weights as a plain checkpoint:
ATOM on the quantized one must give HF's logits on the plain one, and greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from atom import LLM, SamplingParams
from atom.config import ConfigError
from atom.kernels.policy import selected_backend
from atom.layers.quantization import get_quant_config
from atom.testing import hf_greedy, tiny_config
from atom.testing.w4a16 import Scheme, quantization_config, write_w4a16_pair
from tests.models.harness import check_against_hf, make_prompts, write_checkpoint
from tests.models.test_tensor_parallel import _free_port, _worker, run_prefill_and_decode

# Input sizes 256 (attention, gate/up) and 384 (down): whole groups of 32, 64 and 128.
SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2)
CONFIGS = {
    "llama": lambda: tiny_config(
        "LlamaForCausalLM", **SIZES, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen3": lambda: tiny_config(
        "Qwen3ForCausalLM", **SIZES, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    ),
}
SCHEMES = {
    "llama": [
        Scheme("awq", 128),
        Scheme("gptq", 64, symmetric=True, act_order=True),
        Scheme("gptq", 32, gptq_v2=True),
        Scheme("compressed-tensors", 32),
        Scheme("compressed-tensors", -1, symmetric=True),
    ],
    "qwen3": [
        Scheme("awq", 64),
        Scheme("gptq", 128, act_order=True),
        Scheme("gptq", -1, symmetric=True),
        Scheme("compressed-tensors", 128, symmetric=True),
        Scheme("compressed-tensors", 64),
    ],
}
CASES = [(model, scheme) for model, schemes in SCHEMES.items() for scheme in schemes]


def write_pair(tmp_path, model: str, scheme: Scheme, dtype=torch.float32, init_std=0.1):
    # Weights of std 0.1 make greedy choices decisive (no near-ties in the logits).
    source = write_checkpoint(CONFIGS[model](), tmp_path / "source", dtype=dtype, init_std=init_std)
    return write_w4a16_pair(source, tmp_path, scheme)


@pytest.mark.parametrize("model, scheme", CASES, ids=[f"{m}-{s.name}" for m, s in CASES])
def test_logits_equal_hf_on_dequantized_weights(tmp_path, model, scheme):
    quantized, reference = write_pair(tmp_path, model, scheme)
    check_against_hf(reference, [13, 5], decode_steps=3, atom_folder=quantized, atol=2e-4)


@pytest.mark.parametrize("model, scheme", [CASES[1], CASES[6]], ids=["llama-gptq", "qwen3-gptq"])
def test_act_order_sorts_rows_and_permutes_input(tmp_path, model, scheme):
    """The act-order checkpoints above really are out of order: the layer keeps the
    permutation its input goes through."""
    from tests.models.harness import PagedModel

    quantized, _ = write_pair(tmp_path, model, scheme)
    layer = PagedModel(quantized).model.model.layers[0].mlp.down_proj
    assert layer.input_perm is not None
    assert not torch.equal(layer.input_perm, torch.arange(layer.input_perm.numel()))
    assert layer.qweight_w4.dtype == torch.int32 and layer.qweight_w4.shape == (384 // 8, 256)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_greedy_tokens_equal_hf(tmp_path, fmt):
    quantized, reference = write_pair(tmp_path, "qwen3", Scheme(fmt, 64))
    prompts = make_prompts(256, [9, 17, 4], seed=3)
    llm = LLM(
        model=str(quantized),
        dtype="float32",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(reference, prompts, 12)


def test_bfloat16_logits_close_to_hf(tmp_path):
    # HF's initial std (0.02): logits of the size the other bf16 model tests hold to 5e-2.
    scheme = Scheme("gptq", 128)
    quantized, reference = write_pair(tmp_path, "llama", scheme, torch.bfloat16, init_std=None)
    check_against_hf(
        reference, [11], decode_steps=2, dtype=torch.bfloat16, atol=5e-2, atom_folder=quantized
    )


@pytest.mark.parametrize(
    "scheme",
    [Scheme("awq", 32), Scheme("gptq", 64, symmetric=True), Scheme("compressed-tensors", 64)],
    ids=lambda s: s.name,
)
def test_tensor_parallel_2_matches_tp1(tmp_path, scheme):
    """Column-parallel (merged q/k/v, gate/up) and row-parallel layers slice the packed
    words and the group scales on their own axes (GPTQ act-order: see
    test_act_order_row_parallel_errors)."""
    quantized, _ = write_pair(tmp_path, "qwen3", scheme)
    expected = run_prefill_and_decode(str(quantized))
    result_file = str(tmp_path / "tp2.pt")
    mp.start_processes(
        _worker, args=(2, _free_port(), str(quantized), result_file), nprocs=2, start_method="spawn"
    )
    torch.testing.assert_close(torch.load(result_file), expected, atol=1e-4, rtol=0)


def test_cpu_runs_the_torch_reference():
    assert selected_backend("w4a16_gemm", "cpu") == "torch"


def _config(raw: dict):
    return get_quant_config(type("HF", (), {"quantization_config": raw})())


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**quantization_config(Scheme("awq", 128)), "bits": 8}, "awq: bits=8 is unsupported"),
        ({**quantization_config(Scheme("gptq", 128)), "bits": 3}, "gptq: bits=3 is unsupported"),
        (
            {**quantization_config(Scheme("gptq", 128)), "group_size": 96},
            "gptq: group_size=96 is unsupported; supported: 32, 64, 128, -1",
        ),
        (
            {**quantization_config(Scheme("awq", 128)), "zero_point": False},
            "awq: zero_point=False",
        ),
        ({"quant_method": "awq", "group_size": 128}, "awq: quantization_config has no 'bits'"),
        ({"quant_method": "gptq", "bits": 4}, "gptq: quantization_config has no 'group_size'"),
        (
            {**quantization_config(Scheme("gptq", 128)), "checkpoint_format": "marlin"},
            "gptq: checkpoint_format='marlin' is unsupported",
        ),
        (
            {**quantization_config(Scheme("awq", 128)), "version": "gemv"},
            "awq: version='gemv' is unsupported",
        ),
    ],
)
def test_bad_configs_name_the_option(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _config(raw)


def _ct(**weights) -> dict:
    raw = quantization_config(Scheme("compressed-tensors", 128))
    raw["config_groups"]["group_0"]["weights"].update(weights)
    return raw


@pytest.mark.parametrize(
    "raw, message",
    [
        (_ct(num_bits=8), "bits=8 is unsupported"),
        (_ct(strategy="tensor"), "weights strategy='tensor' is unsupported"),
        (_ct(group_size=None), "strategy 'group' needs weights.group_size"),
        (_ct(actorder="group"), "actorder='group'"),
        (_ct(type="float"), "weights type='float' is unsupported"),
    ],
)
def test_bad_compressed_tensors_configs_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        _config(raw)


def _with_quant(tmp_path, arch: str, raw: dict, **sizes):
    folder = write_checkpoint(tiny_config(arch, **sizes), tmp_path / arch)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": raw}))
    return folder


def test_moe_experts_error_names_the_format(tmp_path):
    folder = _with_quant(tmp_path, "Qwen3MoeForCausalLM", quantization_config(Scheme("gptq", 32)))
    with pytest.raises(ConfigError, match="gptq checkpoints with 4-bit MoE experts are unsupp"):
        LLM(model=str(folder), skip_tokenizer_init=True)


def test_group_not_dividing_the_layer_errors(tmp_path):
    raw = quantization_config(Scheme("awq", 128))
    folder = _with_quant(tmp_path, "LlamaForCausalLM", raw, hidden_size=64, intermediate_size=96)
    with pytest.raises(ConfigError, match="group_size 128 does not divide the input size"):
        LLM(model=str(folder), skip_tokenizer_init=True)


def _row_parallel_worker(rank: int, port: int, folder: str, result_file: str) -> None:
    import os

    import torch.distributed as dist

    from atom.distributed import SingleProcessGroup, TorchDistributedGroup, set_tp_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        set_tp_group(TorchDistributedGroup())
        try:
            run_prefill_and_decode(folder)
            message = "no error"
        except ConfigError as exc:
            message = str(exc)
        if rank == 0:
            with open(result_file, "w") as f:
                f.write(message)
    finally:
        set_tp_group(SingleProcessGroup())
        dist.destroy_process_group()


def test_act_order_row_parallel_errors(tmp_path):
    quantized, _ = write_pair(tmp_path, "qwen3", Scheme("gptq", 64, act_order=True))
    result_file = tmp_path / "error.txt"
    mp.start_processes(
        _row_parallel_worker,
        args=(_free_port(), str(quantized), str(result_file)),
        nprocs=2,
        start_method="spawn",
    )
    message = result_file.read_text()
    assert "o_proj: gptq with act-order (desc_act) is unsupported in row-parallel" in message
