"""DeepSeek-V3.2 and GLM-5: DeepSeek-V3 with DeepSeek Sparse Attention (DSA).

Every attention layer is MLA plus a lightning indexer that picks the `index_topk` tokens
each query attends to (atom.layers.dsa_attention); MoE, routing, the layer plan and the
loader are DeepSeek-V3's. GLM-5 (GLM-MoE-DSA) differs in two ways: its indexer rotates
interleaved pairs, and `indexer_types` may mark layers "shared", which reuse the last
"full" layer's selection instead of running an indexer (and keep no indexer keys).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from atom.config import ConfigError
from atom.layers.dsa_attention import SparseLatentAttention
from atom.layers.indexer import SharedSelection
from atom.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2Model,
    DeepseekV3ForCausalLM,
    layer_index,
    mla_arguments,
)

INDEXER_TYPES = ("full", "shared")


def indexer_types(config: Any) -> list[str]:
    """Each layer's indexer kind ("full" by default), checked: one line naming the field."""
    kinds = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
    unknown = sorted(set(kinds) - set(INDEXER_TYPES))
    if unknown:
        raise ConfigError(
            f"config field indexer_types has {unknown}: ATOM runs {', '.join(INDEXER_TYPES)}"
        )
    if len(kinds) < config.num_hidden_layers or kinds[0] != "full":
        raise ConfigError(
            f"config field indexer_types={kinds} must name all {config.num_hidden_layers} "
            "layers, the first 'full' (a 'shared' layer reuses an earlier selection)"
        )
    return kinds


def check_sparse_attention_config(config: Any) -> None:
    """Raises ConfigError naming the field of a DSA config ATOM cannot run."""
    if not config.index_topk >= 1:
        raise ConfigError(f"config field index_topk={config.index_topk} must be >= 1")
    rope = config.qk_rope_head_dim
    if not config.index_head_dim >= rope or config.index_head_dim % 2:
        raise ConfigError(
            f"config field index_head_dim={config.index_head_dim} must be even and hold the "
            f"indexer's rope channels (qk_rope_head_dim={rope})"
        )
    indexer_types(config)


class DeepseekV32DecoderLayer(DeepseekV2DecoderLayer):
    # DeepSeek-V3.2's indexer pairs channel i with i + R/2; GLM-5's pairs 2i with 2i+1.
    indexer_rope_interleaved = False

    def build_attention(
        self, config: Any, quant_config, prefix: str, shared: SharedSelection | None = None
    ) -> nn.Module:
        """shared: the model's selection, which "shared" layers reuse; None for an MTP layer
        (after the model's layers), which runs its own indexer."""
        kinds, index = indexer_types(config), layer_index(prefix)
        indexer = None
        if index >= len(kinds) or kinds[index] == "full":
            indexer = dict(
                num_heads=config.index_n_heads,
                head_dim=config.index_head_dim,
                rope_interleaved=self.indexer_rope_interleaved,
            )
        return SparseLatentAttention(
            mla_arguments(config, quant_config, prefix),
            config.index_topk,
            indexer,
            shared or SharedSelection(),
        )


class DeepseekV32Model(DeepseekV2Model):
    decoder_layer = DeepseekV32DecoderLayer

    def __init__(self, config: Any, quant_config=None, prefix: str = "model", **layer_kwargs):
        check_sparse_attention_config(config)
        super().__init__(config, quant_config, prefix, shared=SharedSelection(), **layer_kwargs)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    model_cls = DeepseekV32Model


class GlmMoeDsaDecoderLayer(DeepseekV32DecoderLayer):
    indexer_rope_interleaved = True


class GlmMoeDsaModel(DeepseekV32Model):
    decoder_layer = GlmMoeDsaDecoderLayer


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    model_cls = GlmMoeDsaModel
