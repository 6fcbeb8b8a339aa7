"""Quantized random checkpoints for `atom bench --quantize`: the bf16 checkpoint's shards
rewritten as a quantizer stores them, so every engine loads the same quantized model with
its own kernels (vLLM: Marlin for GPTQ/AWQ, its MXFP4 MoE for GPT-OSS; ATOM: its Triton
W4A16 GEMM and MXFP4 MoE).

- gptq: 4-bit, group 128, symmetric, no act-order (the GPTQ form every host runs).
- awq: 4-bit, group 128, zero points (AWQ's GEMM layout).
- mxfp4: GPT-OSS's expert stacks as MXFP4 blocks and scales (the released checkpoints' form).
"""

from __future__ import annotations

import json
from pathlib import Path

from atom.bench.workloads import BenchError

QUANTIZATIONS = ("gptq", "awq", "mxfp4")


def check_quantization(method: str | None, architectures: list[str]) -> None:
    """Raises BenchError for an unknown method or MXFP4 on a model without GPT-OSS experts."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise BenchError(f"--quantize {method!r}: known methods are {', '.join(QUANTIZATIONS)}")
    others = [a for a in architectures if a != "GptOssForCausalLM"]
    if method == "mxfp4" and others:
        raise BenchError(f"--quantize mxfp4 quantizes GPT-OSS experts; not {', '.join(others)}")


def _converter(method: str):
    """(tensor name -> whether to quantize it, quantize(name, tensor) -> stored tensors,
    the config's quantization_config)."""
    if method == "mxfp4":
        from atom.testing.mxfp4 import MXFP4_CONFIG, is_mxfp4_expert, mxfp4_expert

        return is_mxfp4_expert, mxfp4_expert, MXFP4_CONFIG
    from atom.testing.w4a16 import (
        Scheme,
        is_quantized_linear,
        quantization_config,
        quantized_linear,
    )

    scheme = Scheme(method, 128, symmetric=method == "gptq")

    def quantize(name, tensor):
        return quantized_linear(name[: -len(".weight")], tensor, scheme)[0]

    return is_quantized_linear, quantize, quantization_config(scheme)


def quantize_checkpoint(folder: Path, method: str) -> None:
    """Rewrites the checkpoint in `folder` in place, shard by shard (on the GPU when there
    is one), with its weight map and config following."""
    import torch
    from safetensors.torch import load_file, save_file

    selected, quantize, quant_config = _converter(method)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    shards = sorted(folder.glob("*.safetensors"))
    for number, shard in enumerate(shards, 1):
        print(f"quantizing ({method}) shard {number}/{len(shards)}: {shard.name}", flush=True)
        stored = {}
        for name, tensor in load_file(shard, device=device).items():
            if selected(name):
                stored.update({k: v.cpu() for k, v in quantize(name, tensor).items()})
            else:
                stored[name] = tensor.cpu()
        save_file(stored, shard, metadata={"format": "pt"})
        if index is not None:
            weight_map = index["weight_map"]
            for name in [n for n, file in weight_map.items() if file == shard.name]:
                del weight_map[name]
            weight_map.update(dict.fromkeys(stored, shard.name))
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quant_config
    config_path.write_text(json.dumps(config, indent=2))
