"""FP8 (e4m3) linear methods: 128x128 block scales (DeepSeek-V3 style) and per-tensor scales.

Activations are quantized on the fly (per token group of 128 for block weights, per
tensor for per-tensor weights, or with a checkpoint's static `input_scale`), then one
scaled GEMM runs with fp32 accumulation.

Block scales come as fp32 (`scale_fmt` "float", DeepSeek-V3) or as powers of two in
float8_e8m0fnu (`scale_fmt` "ue8m0", DeepSeek-V4); either is held as fp32, exactly. The
experts are FP8 too, or MXFP4 where the config says `expert_dtype: "fp4"` (DeepSeek-V4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from atom.config import ConfigError
from atom.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_scaled_mm,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)
from atom.kernels.moe import fused_moe
from atom.layers.quantization.base import LinearMethod, set_weight_attrs
from atom.layers.quantization.ignored_layers import IgnoredLayersConfig
from atom.layers.quantization.mxfp4 import Fp4ExpertsMoEMethod

# What a checkpoint's quantization_config may say, beside the block size: the FP8 element
# format (`fmt`), how block scales are stored (`scale_fmt`) and the experts' format.
ELEMENT_FORMATS = ("e4m3",)
SCALE_FORMATS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")


def _fp8_weight(layer: nn.Module, rows: int, cols: int, weight_loader: Callable) -> None:
    weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False)
    layer.register_parameter(
        "weight", set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
    )


def _flatten(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class Fp8BlockLinearMethod(LinearMethod):
    def __init__(self, block_size: tuple[int, int]):
        self.block_size = block_size

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
    ):
        block_n, block_k = self.block_size
        if len(output_partition_sizes) > 1 and any(n % block_n for n in output_partition_sizes):
            raise ValueError(
                f"{layer.prefix}: merged output sizes {output_partition_sizes} must be multiples "
                f"of the FP8 block size {block_n}"
            )
        rows = sum(output_partition_sizes)
        _fp8_weight(layer, rows, input_size_per_partition, weight_loader)
        scale = nn.Parameter(
            torch.empty(
                -(-rows // block_n), -(-input_size_per_partition // block_k), dtype=torch.float32
            ),
            requires_grad=False,
        )
        set_weight_attrs(
            scale, output_dim=0, input_dim=1, shard_block=block_n, weight_loader=weight_loader
        )
        layer.register_parameter("weight_scale_inv", scale)
        layer.params_dtype = params_dtype

    def apply(self, layer, x, bias):
        x2d, lead = _flatten(x)
        x_q, x_scale = quantize_fp8_per_token_group(x2d, self.block_size[1])
        out = fp8_scaled_mm(
            x_q,
            x_scale,
            layer.weight,
            layer.weight_scale_inv,
            x.dtype,
            bias,
            block_size=self.block_size,
        )
        return out.reshape(*lead, -1)

    def dequantize_weight(self, layer):
        return dequantize_fp8(layer.weight, layer.weight_scale_inv, self.block_size)


class Fp8PerTensorLinearMethod(LinearMethod):
    """One scale per merged shard in the checkpoint, expanded to per-row scales after loading.

    `per_channel` keeps one scale per output row instead (compressed-tensors "channel").
    """

    def __init__(self, static_input_scale: bool, per_channel: bool = False):
        self.static_input_scale = static_input_scale
        self.per_channel = per_channel

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
    ):
        rows = sum(output_partition_sizes)
        _fp8_weight(layer, rows, input_size_per_partition, weight_loader)
        if self.per_channel:
            scale = nn.Parameter(torch.empty(rows, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, output_dim=0, weight_loader=weight_loader)
        else:
            scale = nn.Parameter(
                torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False
            )
            set_weight_attrs(scale, per_shard=True, weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        if self.static_input_scale:
            input_scale = nn.Parameter(
                torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False
            )
            layer.register_parameter(
                "input_scale",
                set_weight_attrs(input_scale, per_shard=True, weight_loader=weight_loader),
            )
        layer.params_dtype = params_dtype

    def process_weights_after_loading(self, layer):
        if self.static_input_scale:
            layer.input_scale = nn.Parameter(
                layer.input_scale.max().reshape(1), requires_grad=False
            )
        if self.per_channel or layer.weight_scale.numel() == 1:
            return
        # Merged shards (q/k/v, gate/up) arrive with their own scales; one scale per
        # output row keeps them exact in a single GEMM (no lossy requantization).
        sizes = torch.tensor(layer.output_partition_sizes, device=layer.weight_scale.device)
        rows = layer.weight_scale.repeat_interleave(sizes).unsqueeze(1)
        layer.weight_scale = nn.Parameter(rows, requires_grad=False)

    def apply(self, layer, x, bias):
        x2d, lead = _flatten(x)
        if self.static_input_scale:
            x_q, x_scale = quantize_fp8_per_tensor(x2d, layer.input_scale)
        elif self.per_channel:
            x_q, x_scale = quantize_fp8_per_token(x2d)
        else:
            x_q, x_scale = quantize_fp8_per_tensor(x2d)
        out = fp8_scaled_mm(x_q, x_scale, layer.weight, layer.weight_scale, x.dtype, bias)
        return out.reshape(*lead, -1)


def _choice(raw: dict, field: str, default: str, allowed: tuple[str, ...], why: str) -> str:
    value = raw.get(field) or default
    if value not in allowed:
        raise ConfigError(
            f"config field quantization_config.{field}={value!r} is not supported: {why} "
            f"({', '.join(allowed)})"
        )
    return value


class Fp8Config(IgnoredLayersConfig):
    """HF `quant_method: "fp8"`: block scales when `weight_block_size` is set, else per tensor."""

    name = "fp8"

    def __init__(
        self,
        weight_block_size: list[int] | None,
        activation_scheme: str,
        ignored: list[str],
        expert_dtype: str = "fp8",
    ):
        super().__init__(ignored)
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"unsupported FP8 activation_scheme {activation_scheme!r}")
        if weight_block_size is not None and activation_scheme != "dynamic":
            raise ValueError("block-scaled FP8 needs activation_scheme 'dynamic'")
        self.block_size = tuple(weight_block_size) if weight_block_size else None
        self.activation_scheme = activation_scheme
        self.expert_dtype = expert_dtype

    @classmethod
    def from_dict(cls, raw: dict) -> Fp8Config:
        ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
        _choice(raw, "fmt", "e4m3", ELEMENT_FORMATS, "ATOM's FP8 kernels take")
        _choice(raw, "scale_fmt", "float", SCALE_FORMATS, "ATOM reads block scales as")
        # Absent, the experts share the other layers' format (DeepSeek's reference and
        # transformers read it so; vLLM 0.32 assumes fp4 for DeepSeek-V4).
        expert_dtype = _choice(
            raw, "expert_dtype", "fp8", EXPERT_DTYPES, "ATOM runs MoE experts as"
        )
        return cls(
            raw.get("weight_block_size"), raw.get("activation_scheme", "dynamic"), ignored,
            expert_dtype,
        )  # fmt: skip

    @property
    def format(self) -> str:
        return "fp8-block" if self.block_size else "fp8-per-tensor"

    def quantized_method(self, prefix: str) -> LinearMethod:
        if self.block_size:
            return Fp8BlockLinearMethod(self.block_size)
        return Fp8PerTensorLinearMethod(static_input_scale=self.activation_scheme == "static")

    def moe_method(self, prefix: str):
        if self.expert_dtype == "fp4":
            return Fp4ExpertsMoEMethod()
        if self.block_size:
            return Fp8BlockMoEMethod(self.block_size)
        if self.activation_scheme != "dynamic":
            raise ValueError("FP8 MoE experts support activation_scheme 'dynamic' only")
        return Fp8PerTensorMoEMethod()


def _expert_param(layer, name: str, shape: tuple[int, ...], dtype, **attrs) -> None:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    layer.register_parameter(
        name, set_weight_attrs(param, weight_loader=layer.weight_loader, **attrs)
    )


class Fp8BlockMoEMethod:
    """Experts with 128x128 block scales (`weight_scale_inv`), as DeepSeek-V3 ships them."""

    checkpoint_format = (
        "the config reads the experts as FP8 with block scales: quantization_config."
        "expert_dtype is 'fp8' or absent; experts stored as FP4 need expert_dtype 'fp4'"
    )

    def __init__(self, block_size: tuple[int, int]):
        self.block_size = block_size

    def create_weights(self, layer, num_experts: int, hidden: int, inter: int, dtype) -> None:
        bn, bk = self.block_size
        if inter % bn or hidden % bk:
            raise ValueError(
                f"{layer.prefix}: expert sizes (hidden {hidden}, intermediate {inter} per rank) "
                f"must be multiples of the FP8 block size {self.block_size}"
            )
        _expert_param(layer, "w13_weight", (num_experts, 2 * inter, hidden), FP8_DTYPE)
        _expert_param(layer, "w2_weight", (num_experts, hidden, inter), FP8_DTYPE)
        scale_shape13 = (num_experts, 2 * inter // bn, hidden // bk)
        _expert_param(layer, "w13_weight_scale_inv", scale_shape13, torch.float32, shard_block=bn)
        _expert_param(
            layer,
            "w2_weight_scale_inv",
            (num_experts, hidden // bn, inter // bk),
            torch.float32,
            shard_block=bk,
        )

    def apply(self, layer, x, topk_weights, topk_ids):
        return fused_moe(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation,
            w13_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
            block_size=self.block_size,
        )  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        pass


class Fp8PerTensorMoEMethod:
    """One scale per expert and projection; activations stay in high precision (W8A16)."""

    def create_weights(self, layer, num_experts: int, hidden: int, inter: int, dtype) -> None:
        _expert_param(layer, "w13_weight", (num_experts, 2 * inter, hidden), FP8_DTYPE)
        _expert_param(layer, "w2_weight", (num_experts, hidden, inter), FP8_DTYPE)
        _expert_param(layer, "w13_weight_scale", (num_experts, 2), torch.float32, per_shard=True)
        _expert_param(layer, "w2_weight_scale", (num_experts, 1), torch.float32, per_shard=True)
        self.intermediate = inter

    def apply(self, layer, x, topk_weights, topk_ids):
        return fused_moe(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation,
            w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
        )  # fmt: skip

    def process_weights_after_loading(self, layer) -> None:
        # gate and up scales become per-row scales of the stacked w13 [E, 2I, 1].
        rows = layer.w13_weight_scale.repeat_interleave(self.intermediate, dim=1).unsqueeze(-1)
        layer.w13_weight_scale = nn.Parameter(rows, requires_grad=False)
