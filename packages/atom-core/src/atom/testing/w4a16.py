"""4-bit weight-only (W4A16) test checkpoints made from an unquantized one: AWQ, GPTQ and
compressed-tensors pack-quantized, each written as its quantizer stores it, next to a plain
"reference" checkpoint holding exactly the weights the quantized one stands for.

The packing here is written from the formats' descriptions, on its own (it shares no code
with ATOM's loaders, which it is there to check): integer codes q in [0, 15] per weight, a
zero point z in [0, 15] and a scale s per (group of input rows, output column), and the
weight (q - z) * s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Which linears read the same input, so share an act-order permutation (GPTQ orders rows
# by the Hessian of the layer input, which q/k/v and gate/up have in common).
_INPUT_OF = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2}
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an AWQ word holds column _AWQ_ORDER[p]


@dataclass(frozen=True)
class Scheme:
    fmt: str  # "awq", "gptq" or "compressed-tensors"
    group_size: int  # -1: one group per output channel
    symmetric: bool = False
    act_order: bool = False  # GPTQ desc_act
    gptq_v2: bool = False  # GPTQ checkpoint_format "gptq_v2" (zero points stored as is)

    @property
    def name(self) -> str:
        parts = [self.fmt, f"g{self.group_size}", "sym" if self.symmetric else "asym"]
        parts += ["actorder"] * self.act_order + ["v2"] * self.gptq_v2
        return "-".join(parts)


def _quantize(w, group_of_row, num_groups: int, symmetric: bool, scale_dtype):
    """w [N, K] -> codes [N, K], zeros [N, G], scales [N, G] (scale_dtype values), weight."""
    import torch

    n, k = w.shape
    lo = w.new_zeros(n, num_groups)
    hi = w.new_zeros(n, num_groups)
    for g in range(num_groups):
        rows = w[:, group_of_row == g]
        lo[:, g], hi[:, g] = rows.min(1).values, rows.max(1).values
    if symmetric:
        scales = (torch.maximum(hi.abs(), lo.abs()) / 7.5).clamp(min=1e-6)
        zeros = torch.full_like(scales, 8.0)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-6)
    scales = scales.to(scale_dtype).float()
    if not symmetric:
        zeros = (-lo / scales).round().clamp(0, 15)
    s, z = scales[:, group_of_row], zeros[:, group_of_row]
    codes = (w / s + z).round().clamp(0, 15)
    return codes.long(), zeros.long(), scales.to(scale_dtype), (codes - z) * s


def _words(nibbles):
    """[..., 8] codes -> [...] int32 words, nibble p in bits 4p..4p+3."""
    import torch

    value = sum(nibbles[..., p].long() << (4 * p) for p in range(8))
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def _pack_last(codes, order=tuple(range(8))):
    """Packs eight consecutive elements of the last axis per word; element order[p] of the
    eight goes to nibble p."""
    grouped = codes.unflatten(-1, (-1, 8))
    return _words(grouped[..., list(order)]).contiguous()


def is_quantized_linear(name: str) -> bool:
    """Whether the checkpoint tensor `name` is a decoder linear's weight, which the 4-bit
    formats quantize (embeddings, norms and the LM head stay as they are)."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-2] in LINEARS and parts[-1] == "weight"


def quantized_linear(prefix: str, w, scheme: Scheme, perm=None) -> tuple[dict, object]:
    """The tensors `scheme`'s quantizer stores for the linear `prefix` of weight w [N, K]
    (on w's device), and the weight they stand for. perm: GPTQ act-order's row order."""
    import torch

    n, k = w.shape
    group = k if scheme.group_size == -1 else scheme.group_size
    num_groups = k // group
    # row -> rank in the (act-order) row order
    position = torch.arange(k, device=w.device) if perm is None else torch.argsort(perm)
    group_of_row = position // group
    scale_dtype = torch.bfloat16 if scheme.fmt == "compressed-tensors" else torch.float16
    codes, zeros, scales, weight = _quantize(
        w.float(), group_of_row, num_groups, scheme.symmetric, scale_dtype
    )
    if scheme.fmt == "awq":
        return {
            f"{prefix}.qweight": _pack_last(codes.T, _AWQ_ORDER),
            f"{prefix}.qzeros": _pack_last(zeros.T, _AWQ_ORDER),
            f"{prefix}.scales": scales.T.contiguous(),
        }, weight
    if scheme.fmt == "gptq":
        stored_zeros = zeros if scheme.gptq_v2 else (zeros - 1) & 0xF
        return {
            f"{prefix}.qweight": _pack_last(codes).T.contiguous(),
            f"{prefix}.qzeros": _pack_last(stored_zeros.T),
            f"{prefix}.scales": scales.T.contiguous(),
            f"{prefix}.g_idx": group_of_row.to(torch.int32),
        }, weight
    tensors = {
        f"{prefix}.weight_packed": _pack_last(codes),
        f"{prefix}.weight_scale": scales.contiguous(),
        f"{prefix}.weight_shape": torch.tensor([n, k]),
    }
    if not scheme.symmetric:
        tensors[f"{prefix}.weight_zero_point"] = _pack_last(zeros.T).T.contiguous()
    return tensors, weight


def quantization_config(scheme: Scheme) -> dict:
    if scheme.fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": scheme.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    if scheme.fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": scheme.group_size,
            "desc_act": scheme.act_order,
            "sym": scheme.symmetric,
            "checkpoint_format": "gptq_v2" if scheme.gptq_v2 else "gptq",
        }
    strategy = "channel" if scheme.group_size == -1 else "group"
    weights = {"num_bits": 4, "type": "int", "symmetric": scheme.symmetric, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = scheme.group_size
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
        },
        "ignore": ["lm_head"],
    }


def write_w4a16_pair(source: str | Path, folder: str | Path, scheme: Scheme) -> tuple[Path, Path]:
    """From the unquantized checkpoint `source` (one safetensors file), under `folder`:
    "<scheme>" with every decoder linear quantized in `scheme`'s format, and
    "<scheme>-reference", unquantized, with the weights the quantized one stands for (in
    the source dtype)."""
    import torch
    from safetensors.torch import load_file, save_file

    source, folder = Path(source), Path(folder)
    gen = torch.Generator().manual_seed(5)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    quantized, reference = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not is_quantized_linear(name):
            quantized[name] = reference[name] = tensor
            continue
        perm = None
        if scheme.act_order:
            parts = name.split(".")
            key = (".".join(parts[:-3]), _INPUT_OF.get(parts[-2], 3))
            if key not in perms:
                perms[key] = torch.randperm(tensor.shape[1], generator=gen)
            perm = perms[key]
        tensors, weight = quantized_linear(name[: -len(".weight")], tensor, scheme, perm)
        quantized.update(tensors)
        reference[name] = weight.to(tensor.dtype)
    config = json.loads((source / "config.json").read_text())
    out = {}
    for kind, tensors, fields in (
        (scheme.name, quantized, {**config, "quantization_config": quantization_config(scheme)}),
        (f"{scheme.name}-reference", reference, config),
    ):
        out[kind] = folder / kind
        out[kind].mkdir(parents=True)
        (out[kind] / "config.json").write_text(json.dumps(fields, indent=2))
        save_file(tensors, out[kind] / "model.safetensors", metadata={"format": "pt"})
    return out[scheme.name], out[f"{scheme.name}-reference"]
