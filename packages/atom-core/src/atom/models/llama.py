"""Llama 2 / 3.x, and the decoder pieces Qwen3 and Mixtral reuse."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from atom.config import get_rope_parameters
from atom.distributed import divide, get_tp_group
from atom.layers.activation import SiluAndMul
from atom.layers.attention import Attention
from atom.layers.attention_spec import QKRope
from atom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_shard,
)
from atom.layers.norm import RMSNorm
from atom.layers.quantization import QuantizationConfig, set_weight_attrs
from atom.layers.rotary import get_rope
from atom.loader import load_with_mapping


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant_config=None, prefix=""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """GQA self-attention; `qk_norm` adds Qwen3's per-head RMSNorm on q and k before rope.

    `attention_bias` gives q/k/v and o biases; `o_proj_bias=False` keeps it off o (GLM).
    `sinks` adds GPT-OSS's learned per-head logit to every softmax denominator.
    `rotary_dim` rotates that many leading features of each head (default: the config's
    `partial_rotary_factor` of them).
    """

    def __init__(
        self,
        config: Any,
        quant_config=None,
        prefix: str = "",
        qk_norm: bool = False,
        o_proj_bias: bool = True,
        sinks: bool = False,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        tp_size = get_tp_group().world_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = (
            getattr(config, "num_key_value_heads", None) or self.total_num_heads
        )
        self.num_heads = divide(self.total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=bias and o_proj_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        rope_parameters = get_rope_parameters(config)
        # transformers 5.x moves partial_rotary_factor into rope_parameters (5.24 only there).
        rotary_factor = rope_parameters.get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            config.max_position_embeddings,
            rope_parameters,
            rotary_dim=rotary_dim or int(self.head_dim * rotary_factor),
        )
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False
            )
            rank = get_tp_group().rank
            set_weight_attrs(self.sinks, weight_loader=partial(copy_shard, index=rank))
        # The attention layer applies the norms and rotary, fused with its KV-cache write
        # where its impl can.
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=_sliding_window(config, prefix),
            qk_rope=QKRope(
                self.rotary_emb,
                self.q_norm if qk_norm else None,
                self.k_norm if qk_norm else None,
            ),
            sinks=self.sinks,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, positions))


def _sliding_window(config: Any, prefix: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        index = int(prefix.split("layers.")[1].split(".")[0])
        if layer_types[index] != "sliding_attention":
            return None
    return window


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, quant_config=None, prefix: str = "", **attn_kwargs):
        super().__init__()
        self.self_attn = self.build_attention(
            config, quant_config, f"{prefix}.self_attn", **attn_kwargs
        )
        self.mlp = self.build_mlp(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_attention(
        self, config: Any, quant_config, prefix: str, qk_norm: bool = False
    ) -> nn.Module:
        return LlamaAttention(config, quant_config, prefix, qk_norm)

    def build_mlp(self, config: Any, quant_config, prefix: str) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config, prefix)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    decoder_layer = LlamaDecoderLayer

    def __init__(self, config: Any, quant_config=None, prefix: str = "model", **layer_kwargs):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, quant_config, f"{prefix}.layers.{i}", **layer_kwargs)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    layer_kwargs: dict[str, Any] = {}
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(
        self, config: Any, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ):
        super().__init__()
        self.config = config
        self.model = self.model_cls(
            config, quant_config, _join(prefix, "model"), **self.layer_kwargs
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def expert_params_mapping(self) -> list:
        return []

    def skip_checkpoint_tensor(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        return name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_with_mapping(
            self,
            weights,
            stacked=self.stacked_params_mapping,
            experts=self.expert_params_mapping(),
            skip=self.skip_checkpoint_tensor,
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
