"""DeepSeek-V4 checkpoints quantized as the releases store them, made from an unquantized
one, and beside each the same model unquantized with the dequantized weights (what HF
transformers runs as the reference).

The release's form (`quant_method: "fp8"`, block 128x128, `fmt: "e4m3"`): the attention
projections and the shared experts as e4m3 `weight` with a power-of-two `scale` per
128x128 block [ceil(N/128), ceil(K/128)]; the routed experts per `expert_dtype`: "fp4"
stores `weight` [N, K/2] int8 (two e2m1 codes a byte, the even input in the low nibble)
with a `scale` [N, K/32] per group of 32 inputs, both scales float8_e8m0fnu ("ue8m0");
"fp8" stores them as the other layers, with fp32 scales (as the FP8-expert release does).
Everything else stays as it was. Each block (FP8) or group (FP4) is first scaled by its
own power of two, so that a scale read from the wrong block or group shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FP8_BLOCK = 128
FP8_LAYERS = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])"
    r"\.weight$"
)
EXPERTS = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def release_quantization_config(expert_dtype: str) -> dict:
    config = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    return {**config, "scale_fmt": "ue8m0"} if expert_dtype == "fp4" else config


def _spread(weight, block_rows: int, block_cols: int, gen):
    """`weight` with each [block_rows, block_cols] tile times its own 2^k, k in [-3, 3]."""
    import torch

    rows, cols = -(-weight.shape[0] // block_rows), -(-weight.shape[1] // block_cols)
    factors = torch.exp2(torch.randint(-3, 4, (rows, cols), generator=gen).float())
    tiled = factors.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return weight * tiled[: weight.shape[0], : weight.shape[1]]


def fp8_blocks(weight, power_of_two: bool) -> tuple[dict, object]:
    """({"weight", "scale"} as stored, the dequantized weight)."""
    import torch

    fp8 = torch.float8_e4m3fn
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK))
    tiles = padded.unflatten(0, (-1, FP8_BLOCK)).unflatten(2, (-1, FP8_BLOCK))
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(fp8).max
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    codes = (weight / full).to(fp8)
    stored_scale = scale.to(torch.float8_e8m0fnu) if power_of_two else scale
    return {"weight": codes, "scale": stored_scale}, codes.float() * full


def fp4_groups(weight) -> tuple[dict, object]:
    """({"weight", "scale"} as stored, the dequantized weight as transformers' own MXFP4
    code reads the same bytes)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from atom.testing.mxfp4 import quantize_mxfp4

    blocks, scales = quantize_mxfp4(weight)
    stored = {
        "weight": blocks.flatten(-2).view(torch.int8),
        "scale": scales.view(torch.float8_e8m0fnu),
    }
    # transformers reads GPT-OSS's experts [E, N, K/32, 16] into [E, K, N].
    dequantized = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)
    return stored, dequantized[0].T.contiguous()


def write_release_quantized_pair(
    source: str | Path, folder: str | Path, expert_dtype: str
) -> tuple[Path, Path]:
    """From the unquantized V4 checkpoint `source` (one safetensors file), `folder`/"quantized"
    (the release's names and form) and `folder`/"reference" (unquantized, `source`'s names)."""
    import torch
    from safetensors.torch import load_file, save_file

    from atom.models.deepseek_v4 import released_name

    source, folder = Path(source), Path(folder)
    gen = torch.Generator().manual_seed(11)
    quantized, reference = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        release = released_name(name.removeprefix("model."))
        fp4 = expert_dtype == "fp4" and EXPERTS.search(release)
        if not (FP8_LAYERS.search(release) or EXPERTS.search(release)):
            quantized[name] = reference[name] = tensor
            continue
        if fp4:
            stored, reference[name] = fp4_groups(_spread(tensor.float(), 1, 32, gen))
        else:
            spread = _spread(tensor.float(), FP8_BLOCK, FP8_BLOCK, gen)
            stored, reference[name] = fp8_blocks(spread, power_of_two=expert_dtype == "fp4")
        stem = release.removesuffix(".weight")
        quantized.update({f"{stem}.{part}": value for part, value in stored.items()})
    config = json.loads((source / "config.json").read_text())
    quantized_config = {
        **config,
        "expert_dtype": expert_dtype,
        "quantization_config": release_quantization_config(expert_dtype),
    }
    for kind, tensors, fields in (
        ("quantized", quantized, quantized_config),
        ("reference", reference, config),
    ):
        out = folder / kind
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(fields, indent=2))
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return folder / "quantized", folder / "reference"
