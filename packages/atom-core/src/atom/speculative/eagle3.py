"""EAGLE-3 drafters for Llama and Qwen3 targets, loaded from their own folder.

The drafter reads three of the target's hidden states (the input of target layers
`eagle_aux_hidden_state_layer_ids`, default 2, N/2 and N-3; id N is the last layer's
output), concatenated and projected by `fc` to its width. Its one decoder layer (the
checkpoint's `midlayer`) attends over [norm(embed(token)), norm(hidden)], twice the
width, and its head scores a draft vocabulary that `d2t` maps to the target's ids:

    h = fc([aux_a, aux_b, aux_c])[p]      out, state = midlayer(embed(t[p+1]), h)
    draft = d2t(argmax(lm_head(norm(out))))

For the next draft the layer reads its own pre-norm output (`state`), as vLLM does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom.config import ConfigError
from atom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom.layers.linear import QKVParallelLinear, ReplicatedLinear
from atom.layers.norm import RMSNorm
from atom.loader import (
    check_all_loaded,
    checkpoint_tensor_names,
    iterate_safetensors,
    load_with_mapping,
    process_weights_after_loading,
)
from atom.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from atom.speculative.aux_hidden import AuxHiddenStates, default_aux_layer_ids

EAGLE3_TARGETS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def aux_layer_ids(config: Any, num_target_layers: int) -> tuple[int, ...]:
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or getattr(
        config, "eagle_aux_hidden_state_layer_ids", None
    )
    return tuple(ids) if ids else default_aux_layer_ids(num_target_layers)


def read_drafter_config(folder: str, target_config: Any, architecture: str) -> Any:
    """The drafter's HF config, checked against the target before any weight loads."""
    from transformers import AutoConfig

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"speculative method 'eagle3': no config.json in drafter folder {folder!r}"
        )
    if architecture not in EAGLE3_TARGETS:
        raise ConfigError(
            f"speculative method 'eagle3' is not supported for {architecture}; it is for "
            f"{list(EAGLE3_TARGETS)}"
        )
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, **raw)
    if config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"EAGLE-3 drafter vocab_size {config.vocab_size} differs from the target's "
            f"{target_config.vocab_size}"
        )
    width = getattr(config, "target_hidden_size", None) or config.hidden_size
    if width != target_config.hidden_size:
        raise ConfigError(
            f"EAGLE-3 drafter reads hidden states of width {width}; the target's are "
            f"{target_config.hidden_size}"
        )
    n = target_config.num_hidden_layers
    ids = aux_layer_ids(config, n)
    if any(not 0 <= i <= n for i in ids):
        raise ConfigError(
            f"EAGLE-3 drafter reads target layers {list(ids)}; the target has {n} (0..{n})"
        )
    return config


class Eagle3Layer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = getattr(config, "norm_before_residual", False)
        self.self_attn = LlamaAttention(config, prefix="layers.0.self_attn")
        attn = self.self_attn
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden,
            attn.head_dim,
            attn.total_num_heads,
            attn.total_num_kv_heads,
            bias=getattr(config, "attention_bias", False),
            prefix="layers.0.self_attn.qkv_proj",
        )
        self.mlp = LlamaMLP(hidden, config.intermediate_size, prefix="layers.0.mlp")
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        joined = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attended, residual = self.post_attention_layernorm(
            self.self_attn(positions, joined), residual
        )
        return self.mlp(attended), residual


class Eagle3Drafter(nn.Module):
    def __init__(self, target: nn.Module, config: Any, own_embedding: bool):
        super().__init__()
        self.hidden_size = hidden = config.hidden_size  # of fc's output and its states
        self.aux_layers = aux_layer_ids(config, target.config.num_hidden_layers)
        self.fc = ReplicatedLinear(target.config.hidden_size * len(self.aux_layers), hidden)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = ParallelLMHead(draft_vocab, hidden)
        self.d2t = None
        if draft_vocab != config.vocab_size:
            # target id = draft id + d2t[draft id]
            self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
            self.embed = self.embed_tokens.forward
        else:
            self.embed = target.model.embed_tokens.forward
        self.aux_hidden = AuxHiddenStates(target.model.layers, self.aux_layers)

    def target_features(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat(self.aux_hidden.take(), dim=-1))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, residual = self.midlayer(positions, self.embed(input_ids), hidden)
        return self.norm(output, residual)

    def draft_tokens(self, output: torch.Tensor, step: int) -> torch.Tensor:
        draft = self.lm_head(output).argmax(-1)
        return draft if self.d2t is None else draft + self.d2t[draft]


def load_eagle3_drafter(target: nn.Module, folder: str, config: Any) -> Eagle3Drafter:
    """Builds the drafter (under the caller's device and dtype) and loads its folder."""
    names = checkpoint_tensor_names(folder)
    drafter = Eagle3Drafter(target, config, own_embedding="embed_tokens.weight" in names)
    loaded = load_with_mapping(
        drafter,
        iterate_safetensors(folder, progress=False),
        stacked=LlamaForCausalLM.stacked_params_mapping,
        skip=lambda name: name == "t2d",
    )
    check_all_loaded(drafter, loaded)
    process_weights_after_loading(drafter)
    return drafter
