"""DeepSeek-V4's attention layer: multi-query attention with one shared K = V head, a
sliding window, per-head sinks, and (CSA / HCA layers) compressed KV entries.

- q by LoRA: wq_a, a weighted RMSNorm (q_norm), wq_b, then an unweighted RMSNorm per head;
- one K = V head: wkv then a weighted RMSNorm (norm); the same rows are keys and values;
- rope on the last qk_rope_head_dim channels of q and kv ("main" rope on sliding-only
  layers, "compress" on the others), and the inverse rotation of the output's rope
  channels at the query's position: the values carried their keys' rotation, which this
  takes back out (the output then depends on the relative distance only);
- a grouped low-rank output: the heads in `o_groups` groups, each projected to
  o_lora_rank by its own block of wo_a, then wo_b over all groups.

CSA layers add a KV compressor with overlap (rate 4 in the releases) and a lightning
indexer (its own compressor at index_head_dim, queries from the q-LoRA latent) that
keeps each query's top `index_topk` entries; HCA layers a compressor without overlap
(rate 128) whose every closed entry is attended. The impl
(`atom.layers.compressed_attention_impl`, or the host's around it) keeps the pages and
attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from atom.layers.attention import create_attention_impl
from atom.layers.compressed_attention_impl import (
    CompressedAttentionSpec,
    CompressedCacheLayout,
    CompressorCache,
    IndexerInputs,
)
from atom.layers.hyper_connection import unweighted_rms_norm
from atom.layers.kv_compressor import KVCompressor, projection_width
from atom.layers.linear import ReplicatedLinear, copy_weight
from atom.layers.norm import RMSNorm
from atom.layers.quantization import QuantizationConfig, UnquantizedLinearMethod
from atom.layers.quantization.dequantized import DequantizedAfterLoading
from atom.layers.rotary import TrailingRotaryEmbedding


@dataclass(frozen=True)
class CompressedAttentionShape:
    """A V4 attention layer's sizes, from the config (atom.models.deepseek_v4)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    norm_eps: float
    compress_rate: int = 0  # 0: sliding-only
    overlap: bool = False  # CSA
    index_n_heads: int = 0  # CSA's indexer, 0: none
    index_head_dim: int = 0
    index_topk: int = 0


class GroupedLinear(nn.Module):
    """x [T, G, K] -> [T, G * N], group g through its own block of `weight` [G * N, K].

    A quantized checkpoint's weight loads as it is stored and is dequantized once, after
    loading (`quant_method`, which the hosts' loaders call too)."""

    def __init__(
        self,
        in_per_group: int,
        out_features: int,
        groups: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.prefix = prefix
        self.groups = groups
        stored_as = (
            quant_config.linear_method(prefix) if quant_config else UnquantizedLinearMethod()
        )
        self.quant_method = DequantizedAfterLoading(stored_as)
        self.quant_method.create_weights(
            self, in_per_group, [out_features], torch.get_default_dtype(), copy_weight
        )

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.weight.view(self.groups, -1, x.shape[-1])  # [G, N, K]
        return torch.einsum("tgk,gnk->tgn", x, blocks).flatten(1)


# CSA's indexer compresses its keys over the same overlapping windows as its layer.
INDEXER_OVERLAP = True


def cache_layout(shape: CompressedAttentionShape) -> CompressedCacheLayout:
    """The cache tensors of a layer of `shape` (its impl's `kv_cache_shapes`), known from
    the config before any layer is built: a host sizes its pool rows from it."""
    compressors = []
    if shape.compress_rate:
        width = projection_width(shape.head_dim, shape.overlap)
        compressors.append(CompressorCache(shape.compress_rate, 2 * width, shape.head_dim))
    if shape.index_n_heads:
        width = projection_width(shape.index_head_dim, INDEXER_OVERLAP)
        compressors.append(CompressorCache(shape.compress_rate, 2 * width, shape.index_head_dim))
    return CompressedCacheLayout(shape.head_dim, tuple(compressors))


class LightningIndexerV4(nn.Module):
    """CSA's indexer: its compressor's rows, and the queries and per-head weights of a
    step (scores over the entries are the impl's, atom.kernels.compressed_attention)."""

    def __init__(
        self,
        shape: CompressedAttentionShape,
        rotary: TrailingRotaryEmbedding,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        self.num_heads, self.head_dim = shape.index_n_heads, shape.index_head_dim
        self.wq_b = ReplicatedLinear(
            shape.q_lora_rank, self.num_heads * self.head_dim, False, quant_config,
            f"{prefix}.wq_b",
        )  # fmt: skip
        # Unquantized in the checkpoints (as are the compressor's), and run in fp32 (as
        # the reference does).
        self.weights_proj = ReplicatedLinear(
            shape.hidden_size, self.num_heads, prefix=f"{prefix}.weights_proj"
        )
        self.weight_scale = (self.num_heads * self.head_dim) ** -0.5
        self.compressor = KVCompressor(
            shape.hidden_size, self.head_dim, shape.compress_rate, INDEXER_OVERLAP, rotary,
            shape.norm_eps, f"{prefix}.compressor",
        )  # fmt: skip
        self.__dict__["rotary"] = rotary

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, q_latent: torch.Tensor
    ) -> IndexerInputs:
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        weights = F.linear(hidden_states.float(), self.weights_proj.weight.float())
        return IndexerInputs(
            self.rotary(positions, q),
            weights * self.weight_scale,
            self.compressor.project(hidden_states),
        )


class CompressedAttention(nn.Module):
    """hidden [T, hidden_size] at positions [T] -> [T, hidden_size].

    With `quant_config`, the projections are quantized as the releases store them (FP8
    blocks): wq_a, wq_b, wkv, wo_a, wo_b and the indexer's wq_b; the compressors and the
    indexer's weights_proj stay unquantized."""

    def __init__(
        self,
        shape: CompressedAttentionShape,
        rotary: TrailingRotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.shape = shape
        h, d = shape.num_heads, shape.head_dim

        def projection(in_features: int, out_features: int, name: str) -> ReplicatedLinear:
            return ReplicatedLinear(
                in_features, out_features, False, quant_config, f"{prefix}.{name}"
            )

        self.wq_a = projection(shape.hidden_size, shape.q_lora_rank, "wq_a")
        self.q_norm = RMSNorm(shape.q_lora_rank, shape.norm_eps)
        self.wq_b = projection(shape.q_lora_rank, h * d, "wq_b")
        self.wkv = projection(shape.hidden_size, d, "wkv")
        self.norm = RMSNorm(d, shape.norm_eps)
        self.wo_a = GroupedLinear(
            h * d // shape.o_groups, shape.o_groups * shape.o_lora_rank, shape.o_groups,
            quant_config, f"{prefix}.wo_a",
        )  # fmt: skip
        self.wo_b = projection(shape.o_groups * shape.o_lora_rank, shape.hidden_size, "wo_b")
        self.attn_sink = nn.Parameter(torch.empty(h, dtype=torch.float32), requires_grad=False)
        self.__dict__["rotary"] = rotary  # the model's, shared by the layers of its rope type
        self.compressor = self.indexer = None
        if shape.compress_rate:
            self.compressor = KVCompressor(
                shape.hidden_size, d, shape.compress_rate, shape.overlap, rotary,
                shape.norm_eps, f"{prefix}.compressor",
            )  # fmt: skip
        if shape.index_n_heads:
            self.indexer = LightningIndexerV4(shape, rotary, quant_config, f"{prefix}.indexer")
        spec = CompressedAttentionSpec(
            layer_name=f"{prefix}.impl",
            num_heads=h,
            num_kv_heads=1,
            head_dim=d,
            v_head_dim=d,
            scale=d**-0.5,
            # The pages it reads: a compressing layer's entries reach back to the start.
            sliding_window=None if shape.compress_rate else shape.sliding_window,
            sinks=self.attn_sink,
            index_topk=shape.index_topk,
            window=shape.sliding_window,
            compressor=self.compressor,
            indexer_compressor=None if self.indexer is None else self.indexer.compressor,
        )
        # The host's impl of it (native: CompressedAttentionImpl; vLLM: a layer of its
        # own around that impl, which owns the pages).
        self.impl = create_attention_impl(spec)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        q_latent = self.q_norm(self.wq_a(hidden_states))
        q = self.wq_b(q_latent).view(-1, shape.num_heads, shape.head_dim)
        q = self.rotary(positions, unweighted_rms_norm(q, shape.norm_eps))
        kv = self.rotary(positions, self.norm(self.wkv(hidden_states)))
        out = self.impl(
            q,
            kv,
            None if self.compressor is None else self.compressor.project(hidden_states),
            None if self.indexer is None else self.indexer(positions, hidden_states, q_latent),
        )
        out = self.rotary(positions, out, inverse=True)
        grouped = out.reshape(
            -1, shape.o_groups, shape.num_heads * shape.head_dim // shape.o_groups
        )
        return self.wo_b(self.wo_a(grouped))
