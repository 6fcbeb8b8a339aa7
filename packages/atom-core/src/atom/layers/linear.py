"""Linear layers with tensor-parallel sharding done by their weight loaders.

Parameters carry `output_dim` / `input_dim` (the axis that is sharded, None if the
parameter is replicated, e.g. a per-tensor scale) and optionally `shard_block` (the
number of weight rows/columns one element stands for, e.g. 128 for FP8 block scales; a
{dim: block} dict where the two axes differ, e.g. 4-bit codes packed eight to an int32
along one axis and group scales along the other) and `per_shard` (one scalar per merged
shard, e.g. per-tensor FP8 scales of q/k/v).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.distributed import divide, get_tp_group
from atom.layers.quantization import QuantizationConfig, UnquantizedLinearMethod


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def copy_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.data.numel() == loaded.numel() == 1:
        loaded = loaded.reshape(param.data.shape)  # scalar scales are stored as [] or [1]
    if param.data.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.data.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def _shard_block(param: nn.Parameter, dim: int) -> int:
    block = getattr(param, "shard_block", 1)
    return block.get(dim, 1) if isinstance(block, dict) else block


def _shard_rows(param: nn.Parameter, loaded: torch.Tensor, dim: int, offset: int, size: int):
    """Checkpoint rows [offset, offset+size) along `dim`, in units of the param's shard block."""
    block = _shard_block(param, dim)
    start, length = offset // block, _ceil_div(size, block)
    if start + length > loaded.shape[dim]:
        raise ValueError(
            f"checkpoint tensor {tuple(loaded.shape)} is too small along dim {dim} "
            f"for rows [{start}, {start + length})"
        )
    return loaded.narrow(dim, start, length)


def copy_shard(param: nn.Parameter, loaded: torch.Tensor, index: int) -> None:
    """Copies shard `index` of `loaded` along dim 0, as long as `param`: a rank's slice of
    a per-head or per-feature vector (attention sinks, a norm over sharded features)."""
    size = param.shape[0]
    copy_weight(param, _shard_rows(param, loaded, 0, index * size, size))


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_partition_sizes: list[int],
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        input_size_per_partition: int | None = None,
    ):
        super().__init__()
        self.prefix = prefix
        self.tp = get_tp_group()
        self.input_size = input_size
        self.output_partition_sizes = output_partition_sizes
        self.input_size_per_partition = input_size_per_partition or input_size
        self.quant_method = (
            quant_config.linear_method(prefix) if quant_config else UnquantizedLinearMethod()
        )
        self.quant_method.create_weights(
            self,
            self.input_size_per_partition,
            output_partition_sizes,
            torch.get_default_dtype(),
            self.weight_loader,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(sum(output_partition_sizes), dtype=torch.get_default_dtype()),
                requires_grad=False,
            )
            self.bias.output_dim = 0
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        copy_weight(param, loaded)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=False, quant_config=None, prefix=""):
        super().__init__(input_size, [output_size], bias, quant_config, prefix)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice (no gather)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        output_sizes: list[int] | None = None,
    ):
        tp_size = get_tp_group().world_size
        self.output_sizes = output_sizes or [output_size]
        partitions = [divide(size, tp_size, f"{prefix} output size") for size in self.output_sizes]
        super().__init__(input_size, partitions, bias, quant_config, prefix)

    def _shard_range(self, shard_id) -> tuple[int, int]:
        """(offset, size) of this rank's rows of one merged shard in the checkpoint tensor."""
        size = self.output_partition_sizes[shard_id]
        return self.tp.rank * size, size

    def _param_offset(self, shard_id) -> int:
        return sum(self.output_partition_sizes[:shard_id])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        index = 0 if shard_id is None else self._shard_index(shard_id)
        if getattr(param, "per_shard", False):
            param.data[index].copy_(loaded.reshape(()))
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            copy_weight(param, loaded)
            return
        if shard_id is None and len(self.output_partition_sizes) > 1:
            # A checkpoint that already stores the merged tensor (e.g. fused qkv).
            offset, size = (
                self.tp.rank * sum(self.output_partition_sizes),
                sum(self.output_partition_sizes),
            )
            copy_weight(param, _shard_rows(param, loaded, output_dim, offset, size))
            return
        offset, size = self._shard_range(index)
        shard = _shard_rows(param, loaded, output_dim, offset, size)
        start = self._param_offset(index) // _shard_block(param, output_dim)
        copy_weight(_Narrowed(param, output_dim, start, shard.shape[output_dim]), shard)

    def _shard_index(self, shard_id) -> int:
        return int(shard_id)


class _Narrowed:
    """A view of part of a parameter that `copy_weight` can fill."""

    def __init__(self, param: nn.Parameter, dim: int, start: int, length: int):
        self.data = param.data.narrow(dim, start, length)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one GEMM (e.g. gate and up); shard_id = index."""

    def __init__(self, input_size, output_sizes, bias=False, quant_config=None, prefix=""):
        super().__init__(input_size, sum(output_sizes), bias, quant_config, prefix, output_sizes)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; KV heads are replicated when tp > kv heads."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        v_head_size: int | None = None,
    ):
        tp_size = get_tp_group().world_size
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.num_heads = divide(total_num_heads, tp_size, f"{prefix} num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:  # each KV head is replicated on whole ranks
                raise ValueError(
                    f"{prefix} num_key_value_heads={total_num_kv_heads} does not divide "
                    f"tensor_parallel_size={tp_size}"
                )
            self.num_kv_heads = 1
            self.kv_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, f"{prefix} num_key_value_heads")
            self.kv_replicas = 1
        sizes = [
            self.num_heads * head_size * tp_size,
            self.num_kv_heads * head_size * tp_size,
            self.num_kv_heads * self.v_head_size * tp_size,
        ]
        super().__init__(hidden_size, sum(sizes), bias, quant_config, prefix, sizes)

    def _shard_index(self, shard_id) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id]

    def _shard_range(self, shard_id) -> tuple[int, int]:
        size = self.output_partition_sizes[shard_id]
        rank = self.tp.rank if shard_id == 0 else self.tp.rank // self.kv_replicas
        return rank * size, size


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        reduce_results: bool = True,
    ):
        tp_size = get_tp_group().world_size
        self.reduce_results = reduce_results
        super().__init__(
            input_size,
            [output_size],
            bias,
            quant_config,
            prefix,
            input_size_per_partition=divide(input_size, tp_size, f"{prefix} input size"),
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None and self.tp.world_size > 1:
            size = self.input_size_per_partition
            loaded = _shard_rows(param, loaded, input_dim, self.tp.rank * size, size)
        copy_weight(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction.
        out = self.quant_method.apply(self, x, None)
        if self.reduce_results and self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
