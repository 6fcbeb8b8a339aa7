"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): hyper-connected residual streams, three kinds of
attention layer and hash-routed MoE layers.

- Every layer's residual is `hc_mult` streams (atom.layers.hyper_connection); the attention
  and the MoE block each read one input collapsed from them and write back into all.
- `layer_types` gives each layer's attention (atom.layers.compressed_attention):
  "sliding_attention" (a window of K = V rows), "compressed_sparse_attention" (CSA: plus
  compressed entries every `compress_rates[...]` tokens with overlap, of which an indexer
  keeps the top `index_topk`), "heavily_compressed_attention" (HCA: plus every entry of a
  coarser compressor, no overlap, no indexer).
- `mlp_layer_types` gives each MoE block's routing (atom.layers.hash_moe): "hash_moe" by
  token id, "moe" by score.

Weights load under the released checkpoints' names (`layers.N.attn.wq_a`, `ffn.experts.E.w1`,
`hc_attn_fn`, `embed`, `head`, ...), which is also how transformers saves the model; the
multi-token-prediction layers (`mtp.*`) are skipped with one log line.

The releases' quantized checkpoints (`quant_method: "fp8"`): the attention projections
and the shared experts in e4m3 with 128x128 block scales (`<layer>.scale`: powers of two
as float8_e8m0fnu where `scale_fmt` is "ue8m0", else fp32), the routed experts as
`expert_dtype` says: "fp4" (MXFP4: e2m1 codes two a byte, an e8m0 scale per 32 inputs)
or "fp8" (blocks, as the rest). Embeddings, head, router, compressors, the indexer's
weights_proj, norms and hyper-connections stay unquantized, as the releases keep them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom.config import ConfigError
from atom.layers.compressed_attention import (
    CompressedAttention,
    CompressedAttentionShape,
    cache_layout,
)
from atom.layers.compressed_attention_impl import CompressedCacheLayout
from atom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom.layers.hash_moe import SCORING_FUNCS, HashMoE
from atom.layers.hyper_connection import HyperConnection, HyperHead
from atom.layers.moe import FusedMoE
from atom.layers.norm import RMSNorm
from atom.layers.quantization.fp8 import Fp8Config
from atom.layers.rotary import TrailingRotaryEmbedding
from atom.loader import load_with_mapping

logger = logging.getLogger(__name__)

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
MLP_LAYER_TYPES = ("hash_moe", "moe")
# The FP8 blocks of the releases, which the FP8 block kernels and the shared experts' TP
# split are laid out for.
FP8_BLOCK = (128, 128)


def rope_dim(config: Any) -> int:
    return int(config.head_dim * config.partial_rotary_factor)


def _named(config: Any, field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config field {field}={value!r} is not supported: {why}")


def check_config(config: Any, quant_config=None) -> None:
    """Raises ConfigError, one line naming the field, for a V4 variant ATOM cannot run."""
    n = config.num_hidden_layers
    for field, known in (
        ("layer_types", (SLIDING, CSA, HCA)),
        ("mlp_layer_types", MLP_LAYER_TYPES),
    ):
        kinds = list(getattr(config, field, None) or [])
        unknown = sorted(set(kinds) - set(known))
        if unknown or len(kinds) != n:
            raise _named(config, field, kinds, f"ATOM runs {n} entries of {', '.join(known)}")
    rates = config.compress_rates or {}
    for kind in (CSA, HCA):
        rate = rates.get(kind)
        if kind in config.layer_types and (
            not isinstance(rate, int) or rate < 2 or rate & (rate - 1)
        ):
            raise _named(
                config, f"compress_rates[{kind!r}]", rate, "ATOM compresses by powers of two >= 2"
            )
    if config.scoring_func not in SCORING_FUNCS:
        raise _named(
            config,
            "scoring_func",
            config.scoring_func,
            f"ATOM scores with {', '.join(SCORING_FUNCS)}",
        )
    rope = rope_dim(config)
    if rope < 2 or rope % 2 or rope > config.head_dim:
        raise _named(
            config,
            "partial_rotary_factor",
            config.partial_rotary_factor,
            "rope needs an even channel count within head_dim",
        )
    if CSA in config.layer_types and config.index_head_dim < rope:
        raise _named(
            config,
            "index_head_dim",
            config.index_head_dim,
            f"the indexer's heads hold the {rope} rope channels",
        )
    if CSA in config.layer_types and config.index_topk < 1:
        raise _named(config, "index_topk", config.index_topk, "must be >= 1")
    if (config.num_attention_heads * config.head_dim) % config.o_groups:
        raise _named(config, "o_groups", config.o_groups, "must divide the heads' channels")
    check_quantization(config, quant_config)


def check_quantization(config: Any, quant_config) -> None:
    """ATOM runs the releases' quantized form: FP8 in 128x128 blocks (Fp8Config checks the
    element and scale formats and `expert_dtype`)."""
    if quant_config is None:
        return
    if not isinstance(quant_config, Fp8Config):
        raise _named(
            config,
            "quantization_config.quant_method",
            quant_config.name,
            "ATOM loads DeepSeek-V4's own 'fp8' checkpoints",
        )
    if quant_config.block_size != FP8_BLOCK:
        raise _named(
            config,
            "quantization_config.weight_block_size",
            list(quant_config.block_size or []) or None,
            f"ATOM runs DeepSeek-V4's FP8 layers in {list(FP8_BLOCK)} blocks, as the releases store them",
        )


def attention_shape(config: Any, index: int) -> CompressedAttentionShape:
    kind = config.layer_types[index]
    return CompressedAttentionShape(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        rope_dim=rope_dim(config),
        q_lora_rank=config.q_lora_rank,
        o_groups=config.o_groups,
        o_lora_rank=config.o_lora_rank,
        sliding_window=config.sliding_window,
        norm_eps=config.rms_norm_eps,
        compress_rate=0 if kind == SLIDING else config.compress_rates[kind],
        overlap=kind == CSA,
        index_n_heads=config.index_n_heads if kind == CSA else 0,
        index_head_dim=config.index_head_dim if kind == CSA else 0,
        index_topk=config.index_topk if kind == CSA else 0,
    )


def cache_layouts(config: Any) -> list[CompressedCacheLayout]:
    """Each layer's cache tensors, from the config alone (a host sizes its pool rows from
    them before building the model)."""
    return [cache_layout(attention_shape(config, i)) for i in range(config.num_hidden_layers)]


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, index: int, rotary: dict[str, nn.Module], quant_config, prefix: str
    ):
        super().__init__()
        rope = "main" if config.layer_types[index] == SLIDING else "compress"
        self.attn = CompressedAttention(
            attention_shape(config, index), rotary[rope], quant_config, f"{prefix}.attn"
        )
        hashed = config.mlp_layer_types[index] == "hash_moe"
        self.ffn = HashMoE(config, hashed, quant_config, f"{prefix}.ffn")
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        hc = (
            config.hc_mult,
            config.hidden_size,
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)

    def forward(
        self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the next layer's streams."""
        block_input, post, comb = self.hc_attn.collapse(streams)
        out = self.attn(positions, self.attn_norm(block_input))
        streams = HyperConnection.expand(streams, out, post, comb)
        block_input, post, comb = self.hc_ffn.collapse(streams)
        out = self.ffn(self.ffn_norm(block_input), input_ids)
        return HyperConnection.expand(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, config: Any, quant_config=None, prefix: str = "model"):
        super().__init__()
        check_config(config, quant_config)
        self.hc_mult = config.hc_mult
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary per rope type ("main": sliding-only layers; "compress": the others,
        # their compressors and indexers), shared by reference; no checkpoint tensors.
        self.rotary = nn.ModuleDict(
            {
                name: TrailingRotaryEmbedding(rope_dim(config), config.rope_parameters[name])
                for name in ("main", "compress")
            }
        )
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(config, i, self.rotary, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(
            config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(input_ids)
        streams = embedded.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids)
        return self.norm(self.hc_head(streams))


# Checkpoint name -> ATOM name, after a leading "model." is dropped (transformers saves
# the released names under "model."); first match wins.
_RENAMES = (
    (re.compile(r"^(embed|embed_tokens)\.weight$"), "model.embed.weight"),
    (re.compile(r"^(head|lm_head)\.weight$"), "lm_head.weight"),
    (re.compile(r"^hc_head(?:\.hc_|_)(fn|base|scale)$"), r"model.hc_head.hc_\1"),
    (re.compile(r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"model.layers.\1.hc_\2.\3"),
    (re.compile(r"^(layers\.\d+\.ffn\.shared_experts)\.w2\."), r"model.\1.down_proj."),
    (re.compile(r"^(layers\.|norm\.)"), r"model.\1"),
)
# A quantized layer's scales: `<layer>.scale` in the releases, `weight_scale_inv` in ATOM
# (as in transformers). The hyper-connections' `hc_*_scale` are weights of their own.
_SCALE = re.compile(r"\.scale$")


# transformers 5.12's DeepSeek-V4 saves under its own module names (its save-time renaming
# misses keys under "model."): the release's names for them, by the module's leaf name.
_ATTENTION_LEAVES = {
    "q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b", "kv_proj": "wkv",
    "kv_norm": "norm", "o_a_proj": "wo_a", "o_b_proj": "wo_b", "sinks": "attn_sink",
}  # fmt: skip
_COMPRESSOR_LEAVES = {
    "kv_proj": "wkv", "gate_proj": "wgate", "position_bias": "ape", "kv_norm": "norm",
}  # fmt: skip
_SHARED_EXPERT_LEAVES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LEAF = r"(\w+)(\.weight)?$"
_MODULE_NAMES = (
    (re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), lambda m: f".hc_{m[1]}_{m[2]}"),
    (re.compile(r"\.input_layernorm\."), lambda m: ".attn_norm."),
    (re.compile(r"\.post_attention_layernorm\."), lambda m: ".ffn_norm."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), lambda m: ".ffn.gate.bias"),
    (
        re.compile(r"\.mlp\.shared_experts\.(\w+)\."),
        lambda m: f".ffn.shared_experts.{_SHARED_EXPERT_LEAVES[m[1]]}.",
    ),
    (re.compile(r"\.mlp\."), lambda m: ".ffn."),
    (re.compile(r"\.self_attn\.compressor\.indexer\.scorer\."), lambda m: ".attn.indexer."),
    (re.compile(r"\.self_attn\.compressor\.indexer\.q_b_proj\."), lambda m: ".attn.indexer.wq_b."),
    (
        re.compile(r"\.self_attn\.compressor\.indexer\." + _LEAF),
        lambda m: f".attn.indexer.compressor.{_COMPRESSOR_LEAVES[m[1]]}{m[2] or ''}",
    ),
    (
        re.compile(r"\.self_attn\.compressor\." + _LEAF),
        lambda m: f".attn.compressor.{_COMPRESSOR_LEAVES[m[1]]}{m[2] or ''}",
    ),
    (
        re.compile(r"\.self_attn\." + _LEAF),
        lambda m: f".attn.{_ATTENTION_LEAVES[m[1]]}{m[2] or ''}",
    ),
)


def released_name(name: str) -> str:
    """A layer tensor's name in the release's terms (transformers 5.12's module names ->
    the release's; release names pass through)."""
    if not name.startswith("layers."):
        return name
    for pattern, replacement in _MODULE_NAMES:
        if pattern.search(name):
            return pattern.sub(replacement, name, count=1)
    return name


def atom_name(name: str) -> str:
    name = released_name(name.removeprefix("model."))
    name = _SCALE.sub(".weight_scale_inv", name)
    for pattern, replacement in _RENAMES:
        if pattern.search(name):
            return pattern.sub(replacement, name, count=1)
    return name


class DeepseekV4ForCausalLM(nn.Module):
    model_cls = DeepseekV4Model
    stacked_params_mapping = [
        (".shared_experts.gate_up_proj", ".shared_experts.w1", 0),
        (".shared_experts.gate_up_proj", ".shared_experts.w3", 1),
    ]

    def __init__(self, config: Any, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped_mtp: list[str] = []
        tied = getattr(self.config, "tie_word_embeddings", False)

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("mtp."):
                    skipped_mtp.append(name)
                    continue
                name = atom_name(name)
                if not (tied and name == "lm_head.weight"):
                    yield name, tensor

        loaded = load_with_mapping(
            self,
            renamed(),
            stacked=self.stacked_params_mapping,
            experts=FusedMoE.make_expert_params_mapping(
                "w1", "w2", "w3", self.config.n_routed_experts
            ),
        )
        if skipped_mtp:
            logger.info(
                "%s: skipped the checkpoint's %d multi-token-prediction tensors (mtp.*; not run by ATOM)",
                type(self).__name__,
                len(skipped_mtp),
            )
        return loaded
