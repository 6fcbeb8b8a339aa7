"""GPT-OSS checkpoints with MXFP4 experts, made from an unquantized one (as the released
checkpoints store them: `*_blocks` / `*_scales` next to a `quant_method: mxfp4` config)."""

from __future__ import annotations

import json
from pathlib import Path

_NOT_QUANTIZED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def quantize_mxfp4(linear):
    """[..., K] -> blocks [..., K/32, 16] uint8 and scales [..., K/32] uint8 (OCP MX: the
    shared exponent puts each group's largest value at or below e2m1's 6.0)."""
    import torch

    from atom.kernels.moe_mxfp4 import E2M1_MAGNITUDES

    codes_by_value = torch.tensor(E2M1_MAGNITUDES, device=linear.device)
    groups = linear.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs().unsqueeze(-1) - codes_by_value).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def is_mxfp4_expert(name: str) -> bool:
    """Whether the checkpoint tensor `name` is a GPT-OSS expert stack that MXFP4 stores."""
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def mxfp4_expert(name: str, tensor) -> dict:
    """The `*_blocks` / `*_scales` pair stored for the expert stack `name` [E, K, N]."""
    blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # the Linear layout
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": _NOT_QUANTIZED}


def write_mxfp4_pair(source: str | Path, folder: str | Path) -> tuple[Path, Path]:
    """From the unquantized GPT-OSS checkpoint `source` (one safetensors file), the same
    model twice under `folder`: "mxfp4" with MXFP4 experts, and "reference", unquantized,
    with those experts as HF's own MXFP4 dequantization gives them (the expert MLP must be
    a multiple of 32, MXFP4's group)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source, folder = Path(source), Path(folder)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if is_mxfp4_expert(name):
            packed = mxfp4_expert(name, tensor)
            quantized.update(packed)
            dequantized[name] = convert_moe_packed_tensors(*packed.values(), dtype=tensor.dtype)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((source / "config.json").read_text())
    for kind, tensors, fields in (
        ("mxfp4", quantized, {**config, "quantization_config": MXFP4_CONFIG}),
        ("reference", dequantized, config),
    ):
        out = folder / kind
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(fields, indent=2))
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return folder / "mxfp4", folder / "reference"
