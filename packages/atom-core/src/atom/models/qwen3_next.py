"""Qwen3-Next: a hybrid of Gated DeltaNet layers (linear attention with a per-request
recurrent state) and gated full-attention layers, with sparse MoE blocks that add a gated
shared expert. Also the pieces Qwen3.5 (atom.models.qwen3_5) shares.

- Layer kinds come from the config's `layer_types` ("linear_attention" /
  "full_attention"; older configs: every `full_attention_interval`-th layer is full).
- Full attention: q_proj gives each head's query and an output gate (sigmoid, applied
  before o_proj); per-head QK-norm; rotary on `partial_rotary_factor` of each head.
- Every RMSNorm but the DeltaNet's output norm is zero-centred (weight w, scale 1 + w).
- The DeltaNet's checkpoint projections are grouped by key head: in_proj_qkvz rows are,
  per key head, [q, k, its value heads' v, their z]; in_proj_ba likewise [b, a].
- MoE: softmax top-k routing, plus a shared expert scaled by sigmoid(shared_expert_gate).

Released checkpoints carry multi-token-prediction weights (`mtp.*`): the drafter's under
speculative decoding (atom.speculative.qwen3_next_mtp), else skipped on load with one log
line.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom.config import ConfigError, get_rope_parameters
from atom.distributed import divide, get_tp_group
from atom.layers.attention import Attention
from atom.layers.attention_spec import QKRope
from atom.layers.embedding import VocabParallelEmbedding
from atom.layers.gated_delta_net import GatedDeltaNet
from atom.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom.layers.moe import FusedMoE
from atom.layers.norm import ZeroCentredRMSNorm
from atom.layers.rotary import get_rope
from atom.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from atom.models.qwen3_moe import is_sparse_layer

logger = logging.getLogger(__name__)

LAYER_TYPES = ("linear_attention", "full_attention")

# Checkpoint prefixes of parts ATOM does not run, and how the log line names them.
SKIPPED_PARTS = {
    "mtp.": "multi-token-prediction layers",
    "model.visual.": "vision tower",
}
# Multimodal Qwen3.5 checkpoints nest the text model here.
MULTIMODAL_TEXT_PREFIX = "model.language_model."


def hybrid_layer_types(config: Any) -> list[str]:
    """Each layer's kind, from `layer_types` or else `full_attention_interval`; raises
    ConfigError naming the field and value when they do not describe every layer."""
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        interval = getattr(config, "full_attention_interval", None)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ConfigError(
                f"config field full_attention_interval={interval!r} must be a positive "
                "integer when the config gives no layer_types"
            )
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"config field layer_types has {len(layer_types)} entries "
            f"({list(layer_types)!r}) but num_hidden_layers={num_layers}"
        )
    for index, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ConfigError(
                f"config field layer_types[{index}]={kind!r} is not a layer type ATOM runs "
                f"for this model; expected one of {LAYER_TYPES}"
            )
    return list(layer_types)


def layer_index(prefix: str) -> int:
    return int(prefix.split("layers.")[1].split(".")[0])


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Input projections grouped by key head (in_proj_qkvz, in_proj_ba): a rank's
    contiguous rows are exactly its key heads' groups."""

    def build_projections(self, config: Any, quant_config, prefix: str) -> None:
        tp_size = get_tp_group().world_size
        self.in_proj_qkvz = ColumnParallelLinear(
            config.hidden_size,
            2 * (self.key_dim + self.value_dim) * tp_size,
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj_qkvz",
        )
        self.in_proj_ba = ColumnParallelLinear(
            config.hidden_size,
            2 * self.num_v_heads * tp_size,
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj_ba",
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_tokens, heads = x.shape[0], self.num_k_heads
        per_key = self.num_v_heads // heads  # value heads of each key head
        qkvz = self.in_proj_qkvz(x).view(num_tokens, heads, -1)
        q, k, v, z = qkvz.split(
            [
                self.head_k_dim,
                self.head_k_dim,
                per_key * self.head_v_dim,
                per_key * self.head_v_dim,
            ],
            dim=-1,
        )
        b, a = self.in_proj_ba(x).view(num_tokens, heads, 2 * per_key).split(per_key, dim=-1)
        # The conv reads [q | k | v] of all heads, the checkpoint groups them by key head:
        # each part is copied once, straight into its place.
        mixed = qkvz.new_empty(num_tokens, self.conv_dim)
        for part, start in zip((q, k, v), (0, self.key_dim, 2 * self.key_dim)):
            width = heads * part.shape[-1]
            mixed[:, start : start + width].view(num_tokens, heads, -1).copy_(part)
        # b and a stay as the projection groups them (gated_delta_gates reads them there).
        return mixed, z.reshape(num_tokens, self.num_v_heads, self.head_v_dim), b, a


class GatedAttention(nn.Module):
    """GQA attention whose q_proj also gives a per-head output gate (each head's rows:
    query, then gate), with zero-centred QK-norm and partial rotary."""

    def __init__(self, config: Any, quant_config=None, prefix: str = ""):
        super().__init__()
        tp_size = get_tp_group().world_size
        total_heads = config.num_attention_heads
        total_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = divide(total_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = max(1, total_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        # Twice the query heads: each head's query rows, then its gate rows.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * total_heads,
            total_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        rope_parameters = get_rope_parameters(config)
        rotary_factor = rope_parameters.get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            config.max_position_embeddings,
            rope_parameters,
            rotary_dim=int(self.head_dim * rotary_factor),
        )
        # The zero-centred norms run here; the attention layer rotates (and writes the cache).
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            qk_rope=QKRope(self.rotary_emb),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q_and_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_and_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).reshape(num_tokens, self.q_size)
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        out = self.attn(q, k.reshape(num_tokens, self.kv_size), v, positions)
        # sigmoid reads the gate's head-split view and writes it contiguous: no copy first.
        gated = out.view(num_tokens, self.num_heads, self.head_dim) * torch.sigmoid(gate)
        return self.o_proj(gated.view(num_tokens, self.q_size))


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax top-k) plus a shared expert scaled per token by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: Any, quant_config, prefix: str, renormalize: bool):
        super().__init__()
        # The routers stay unquantized: FP8 checkpoints keep them in high precision.
        self.gate = ReplicatedLinear(
            config.hidden_size, config.num_experts, prefix=f"{prefix}.gate"
        )
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=renormalize,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.shared_expert = LlamaMLP(
            config.hidden_size,
            config.shared_expert_intermediate_size,
            quant_config,
            f"{prefix}.shared_expert",
        )
        self.shared_expert_gate = ReplicatedLinear(
            config.hidden_size, 1, prefix=f"{prefix}.shared_expert_gate"
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = self.experts(hidden_states, self.gate(hidden_states))
        shared = self.shared_expert(hidden_states)
        return routed + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared


class Qwen3NextDecoderLayer(nn.Module):
    """A DeltaNet (`linear_attn`) or gated attention (`self_attn`) layer, then the MLP;
    pre-norm residual blocks with zero-centred norms."""

    linear_attention_cls: type[GatedDeltaNet] = Qwen3NextGatedDeltaNet

    def __init__(self, config: Any, quant_config=None, prefix: str = ""):
        super().__init__()
        index = layer_index(prefix)
        self.is_linear = hybrid_layer_types(config)[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = self.linear_attention_cls(
                config, quant_config, f"{prefix}.linear_attn"
            )
        else:
            self.self_attn = GatedAttention(config, quant_config, f"{prefix}.self_attn")
        self.mlp = self.build_mlp(config, quant_config, f"{prefix}.mlp", index)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config: Any, quant_config, prefix: str, index: int) -> nn.Module:
        if is_sparse_layer(config, index):
            return SharedExpertMoE(config, quant_config, prefix, config.norm_topk_prob)
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config, prefix)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.is_linear:
            hidden_states = self.linear_attn(hidden_states)
        else:
            hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class HybridModel(LlamaModel):
    """LlamaModel's forward over hybrid decoder layers and a zero-centred final norm."""

    decoder_layer = Qwen3NextDecoderLayer

    def __init__(self, config: Any, quant_config=None, prefix: str = "model"):
        nn.Module.__init__(self)
        hybrid_layer_types(config)  # a bad layer list fails here, before any layer is built
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_cls = HybridModel

    def expert_params_mapping(self) -> list:
        if not getattr(self.config, "num_experts", 0):
            return []
        return FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.config.num_experts
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped: Counter[str] = Counter()
        drafter = getattr(self, "drafter", None)
        if drafter is not None:  # speculative decoding runs the MTP module (qwen3_next_mtp)
            weights = drafter.checkpoint_names(weights, "drafter")

        def text_model_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(MULTIMODAL_TEXT_PREFIX):
                    name = "model." + name.removeprefix(MULTIMODAL_TEXT_PREFIX)
                part = next((p for p in SKIPPED_PARTS if name.startswith(p)), None)
                if part is not None:
                    skipped[part] += 1
                    continue
                yield name, tensor

        loaded = super().load_weights(text_model_weights())
        for part, count in skipped.items():
            logger.info(
                "%s: skipped the checkpoint's %s (%d tensors; ATOM runs the text model)",
                type(self).__name__,
                SKIPPED_PARTS[part],
                count,
            )
        return loaded
