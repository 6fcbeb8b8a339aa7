"""ATOM's MTP drafter as the draft model of vLLM's speculative decoding (method "mtp").

For a DeepSeek-V3, GLM-4.5, DeepSeek-V3.2 or GLM-5 checkpoint, vLLM's speculative config
rewrites the draft model's config to the architecture "DeepSeekMTPModel" /
"Glm4MoeMTPModel" / "DeepseekV32MTPModel" (the last for both sparse-attention families)
and builds that class with the engine's `vllm_config`, whose model config is the
target's. `register()` registers these names to `AtomMtpDrafter`, which builds
`atom.speculative.mtp.MtpDrafter` (the native engine's) with ATOM's attention layers on
vLLM's caches, as the target wrapper does
(`atom_vllm.model`): the drafter's layers are more layers of the model's KV-cache groups,
and their step is ATOM's one metadata (`atom_vllm.step.StepBridge`). vLLM's own
DeepSeek MTP layer runs vLLM's MLA attention, which has no CPU backend; ATOM's runs ATOM's.

vLLM's proposer drives it: it shares the target's embedding with it
(`model.embed_tokens`, set after loading), calls `forward(input_ids, positions,
hidden_states, spec_step_idx=...)` per draft step and `compute_logits`. A family whose
next draft reads the layer's normed output (DeepSeek-V3) returns (output, normed
output): vLLM's `model_returns_tuple` names the same architectures. Each MTP layer keeps
its checkpoint head (`shared_head.head`), as ATOM's native engine does. vLLM puts the
target's `lm_head` there when the target has one; ATOM's wrapper has none, so a
checkpoint whose MTP head differs from its LM head drafts as in ATOM's native engine,
not as in vLLM's own (the output is the target's either way).
`model_impl="vllm"` builds vLLM's own drafter, as it builds vLLM's own target.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from atom.layers.attention import attention_backend
from atom.loader import load_with_mapping
from atom.speculative.config import MTP_RECYCLES_NORMED
from atom.speculative.mtp import MtpDrafter
from atom_vllm import MTP_DRAFT_ARCHITECTURES
from atom_vllm.attention_layer import vllm_attention_factory
from atom_vllm.config import UnsupportedVllmFeature, bridge, vllm_own_reason
from atom_vllm.distributed import install_vllm_groups
from atom_vllm.model import ATOM_VLLM_LAYERS, process_atom_weights, vllm_own_model
from atom_vllm.step import StepBridge

logger = init_logger("vllm.atom_vllm.mtp")


class AtomMtpDrafter(nn.Module):
    def __new__(cls, *, vllm_config: Any, prefix: str = ""):
        # A run of vLLM's own target (model_impl="vllm", LoRA) drafts with vLLM's drafter.
        reason = vllm_own_reason(vllm_config)
        if reason is not None:
            draft_config = vllm_config.speculative_config.draft_model_config.hf_config
            return vllm_own_model(draft_config.architectures[0], vllm_config, prefix, reason)
        return super().__new__(cls)

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        super().__init__()
        draft_config = vllm_config.speculative_config.draft_model_config.hf_config
        draft, architecture = draft_config.architectures[0], vllm_config.model_config.architecture
        if architecture not in MTP_DRAFT_ARCHITECTURES[draft]:
            raise UnsupportedVllmFeature(
                f"ATOM's MTP drafter {draft} does not draft for {architecture}; run "
                "model_impl='vllm' or set ATOM_DISABLE_VLLM_PLUGIN=1"
            )
        run = bridge(vllm_config, architecture)
        install_vllm_groups(vllm_config)
        self.target_cls = run.entry.load_class()
        # The target's config: vLLM renames the draft's model_type ("deepseek_mtp"), which
        # ATOM's MoE reads its routing defaults from.
        self.config = run.hf_config
        with attention_backend(vllm_attention_factory(vllm_config)):
            # vLLM's name: its proposer sets `model.embed_tokens` to the target's.
            self.model = MtpDrafter(
                run.hf_config,
                self.target_cls.model_cls.decoder_layer,
                run.quant_config,
                MTP_RECYCLES_NORMED[architecture],
            )
        self.step_bridge = StepBridge(
            [m for m in self.model.modules() if isinstance(m, ATOM_VLLM_LAYERS)]
        )
        layers = [m for m in self.model.modules() if isinstance(m, AttentionLayerBase)]
        logger.info(
            "ATOM MTP drafter for %s built for vLLM: MTP layers %s, %d attention layers on %s",
            architecture,
            list(self.model.layers),
            len(layers),
            ", ".join(sorted({m.get_attn_backend().__name__ for m in layers})),
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's output (what `compute_logits` reads) and, for a family that
        recycles it normed, the normed output the next draft step reads."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        layer = self.model.layer(spec_step_idx)
        with self.step_bridge.step(positions):
            hidden = layer(inputs_embeds, positions, hidden_states)
        if self.model.recycle_normed:
            return hidden, layer.shared_head.norm(hidden)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.model.layer(spec_step_idx).logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's MTP layers (vLLM's iterator yields the whole checkpoint), with
        the target class's name mappings (they read only `config`)."""
        first = self.model.first_index
        own = (
            (name, tensor)
            for name, tensor in self.model.checkpoint_names(weights, "model")
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= first
        )
        loaded = load_with_mapping(
            self,
            own,
            stacked=self.target_cls.stacked_params_mapping,
            experts=self.target_cls.expert_params_mapping(self),
        )
        process_atom_weights(self.model)
        return loaded
