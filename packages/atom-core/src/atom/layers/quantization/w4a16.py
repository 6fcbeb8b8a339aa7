"""4-bit weight-only linear layers (W4A16), shared by the AWQ, GPTQ and compressed-tensors
pack-quantized formats.

A format registers its checkpoint tensors as they are stored (so tensor parallelism and
merged q/k/v, gate/up shards slice the packed words along the right axis), and after
loading says what they mean: codes [K, N] in [0, 15], zero points and scales [G, N], and
for act-order the group of each input row. This class then repacks everything into the
one layout the W4A16 GEMM reads (`atom.kernels.w4a16`: codes packed eight to an int32
along K, [G, N] scales and zeros), sorting act-order rows by group and keeping the
permutation that x's columns go through before the GEMM.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from atom.config import ConfigError
from atom.kernels.w4a16 import PACK_FACTOR, pack_int4_rows, w4a16_gemm
from atom.layers.quantization.base import LinearMethod, set_weight_attrs
from atom.layers.quantization.ignored_layers import IgnoredLayersConfig
from atom.layers.quantization.unquantized import UnquantizedMoEMethod

SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] | None = None):
    """int32 words -> 4-bit codes, eight per word along `dim`. Nibble p (bits 4p..4p+3) of
    a word holds element `order[p]` of its eight (default: element p)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    packed = packed.movedim(dim, -1)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    if order is not None:
        codes = codes[..., torch.tensor(order).argsort()]
    return codes.flatten(-2).movedim(-1, dim)


def checkpoint_param(
    layer: nn.Module,
    name: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
    dims: tuple[int | None, int | None],
    blocks: dict[int, int],
    weight_loader,
) -> None:
    """A checkpoint tensor; dims = (input_dim, output_dim), blocks = checkpoint rows or
    columns per element along an axis (8 for packed codes, the group size for scales)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    input_dim, output_dim = dims
    set_weight_attrs(
        param,
        input_dim=input_dim,
        output_dim=output_dim,
        shard_block=blocks,
        weight_loader=weight_loader,
    )
    layer.register_parameter(name, param)


def grouped_zeros_and_scales(
    layer: nn.Module, shape: LayerShape, scale_dtype, weight_loader
) -> None:
    """AWQ's and GPTQ's per-group tensors: `qzeros` int32 [G, N/8] (packed along the
    output axis) and `scales` [G, N]."""
    group_dim = 0 if shape.groups_sharded else None
    checkpoint_param(
        layer, "qzeros", (shape.num_groups, shape.output_size // 8), torch.int32,
        (group_dim, 1), {0: shape.group_size, 1: 8}, weight_loader,
    )  # fmt: skip
    checkpoint_param(
        layer, "scales", (shape.num_groups, shape.output_size), scale_dtype, (group_dim, 1),
        {0: shape.group_size}, weight_loader,
    )  # fmt: skip


@dataclass
class LayerShape:
    """A layer's rank-local sizes and the group layout its checkpoint tensors follow."""

    input_size: int  # K on this rank
    output_size: int  # N on this rank (all merged shards)
    group_size: int  # rows per group on this rank (K for per-channel)
    groups_sharded: bool  # scales / zeros split along K with the weight (row parallel)

    @property
    def num_groups(self) -> int:
        return self.input_size // self.group_size


class W4A16LinearMethod(LinearMethod):
    """Subclasses register a format's tensors (`create_format_weights`) and decode them
    (`decode`); loading, repacking and the GEMM are here."""

    format: str

    def __init__(self, config: W4A16Config):
        self.config = config

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader
    ):
        group = self.config.group_size
        k, n = input_size_per_partition, sum(output_partition_sizes)
        row_sharded = input_size_per_partition != layer.input_size
        if k % PACK_FACTOR or any(size % PACK_FACTOR for size in output_partition_sizes):
            raise ConfigError(
                f"{layer.prefix}: {self.format} needs input size ({k} per rank) and output "
                f"sizes ({output_partition_sizes} per rank) divisible by {PACK_FACTOR}"
            )
        if group != -1 and k % group:
            raise ConfigError(
                f"{layer.prefix}: group_size {group} does not divide the input size per rank "
                f"({k}); use a tensor-parallel size that keeps whole groups on each rank"
            )
        if self.config.act_order and row_sharded:
            raise ConfigError(
                f"{layer.prefix}: {self.format} with act-order (desc_act) is unsupported in "
                "row-parallel layers under tensor parallelism (groups span ranks); use "
                "tensor_parallel_size=1 or a checkpoint without desc_act"
            )
        shape = LayerShape(k, n, k if group == -1 else group, group != -1)
        # Scales load into fp32 whatever the model dtype: fp16 / bf16 scales stay exact.
        self.create_format_weights(layer, shape, torch.float32, weight_loader)
        layer.w4a16_shape = shape

    @abstractmethod
    def create_format_weights(
        self, layer: nn.Module, shape: LayerShape, scale_dtype: torch.dtype, weight_loader
    ) -> None:
        """Registers the checkpoint's tensors of this format."""

    @abstractmethod
    def decode(
        self, layer: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes [K, N] in [0, 15], zeros [G, N], scales [G, N], group of each input row
        [K] for act-order or None) from the loaded checkpoint tensors; deletes them."""

    def process_weights_after_loading(self, layer):
        codes, zeros, scales, row_groups = self.decode(layer)
        shape: LayerShape = layer.w4a16_shape
        perm = None
        if row_groups is not None:
            perm = torch.argsort(row_groups, stable=True)
            expected = torch.arange(shape.input_size, device=perm.device) // shape.group_size
            if not torch.equal(row_groups[perm].long(), expected):
                raise ConfigError(
                    f"{layer.prefix}: act-order g_idx does not put {shape.group_size} rows in "
                    "each group"
                )
            codes = codes[perm]
        layer.qweight_w4 = nn.Parameter(pack_int4_rows(codes), requires_grad=False)
        layer.scales_w4 = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        layer.zeros_w4 = nn.Parameter(zeros.float().contiguous(), requires_grad=False)
        layer.register_buffer("input_perm", perm, persistent=False)

    def apply(self, layer, x, bias):
        x2d = x.reshape(-1, x.shape[-1])
        if layer.input_perm is not None:
            x2d = x2d[:, layer.input_perm]
        out = w4a16_gemm(
            x2d,
            layer.qweight_w4,
            layer.scales_w4,
            layer.zeros_w4,
            layer.w4a16_shape.group_size,
            bias,
        )
        return out.reshape(*x.shape[:-1], -1)


def drop_params(layer: nn.Module, *names: str) -> list[torch.Tensor]:
    """The named checkpoint tensors' data, removed from the layer."""
    tensors = [getattr(layer, name).data for name in names]
    for name in names:
        delattr(layer, name)
    return tensors


class W4A16Config(IgnoredLayersConfig):
    """What every 4-bit weight-only format shares: bits, group size, act-order, the layers
    left unquantized, and no 4-bit MoE experts."""

    method_class: type[W4A16LinearMethod]
    format: str

    def __init__(self, bits, group_size, act_order: bool, ignored: list[str]):
        super().__init__(ignored)
        if bits != 4:
            raise ConfigError(
                f"{self.format}: bits={bits!r} is unsupported; ATOM loads 4-bit weights only"
            )
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ConfigError(
                f"{self.format}: group_size={group_size!r} is unsupported; supported: "
                f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (-1: one group per channel)"
            )
        self.group_size = group_size
        # With a single group per channel, the row order cannot matter.
        self.act_order = act_order and group_size != -1

    def quantized_method(self, prefix: str) -> LinearMethod:
        return self.method_class(self)

    def moe_method(self, prefix: str):
        if self.is_ignored(prefix):
            return UnquantizedMoEMethod()
        raise ConfigError(
            f"{prefix}: {self.format} checkpoints with 4-bit MoE experts are unsupported "
            "(ATOM's 4-bit weight-only layers are dense linear layers only)"
        )
