"""Tiny DeepSeek-V3 and GLM-4.5 checkpoints with an MTP layer, for the native engine's and
the host plugins' speculative-decoding tests.

HF transformers does not run MTP layers, so these are built from a checkpoint of one
more decoder layer: its last layer becomes the MTP layer's decoder block, and enorm,
hnorm, eh_proj and the shared head are added. Two drafters: `random` (its drafts are
almost never the target's: every step rejects) and `repeat`, whose eh_proj passes the
next token's embedding through, whose block adds nothing (o_proj and down projections
zero) and whose head is the embedding matrix: it drafts the token it reads again, which
a random target's repetitive output often accepts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atom.testing.tiny_configs import tiny_config, write_checkpoint

REPEAT_LEAN = 1.0
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_nextn_predict_layers=1)
CONFIGS = {
    "deepseek-v3": lambda layers: tiny_config(
        "DeepseekV3ForCausalLM",
        **SMALL,
        num_hidden_layers=layers,
        moe_intermediate_size=32,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
    ),
    "glm-4.5": lambda layers: tiny_config(
        "Glm4MoeForCausalLM", **SMALL, num_hidden_layers=layers, moe_intermediate_size=48
    ),
}


def write_mtp_checkpoint(
    family: str, folder: Path, drafter: str, num_layers: int = 2, vocab_size: int = 256
) -> Path:
    config = CONFIGS[family](num_layers + 1)
    config.vocab_size = vocab_size
    write_checkpoint(config, folder, init_std=0.1)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    hidden = SMALL["hidden_size"]
    mtp = f"model.layers.{num_layers}."
    gen = torch.Generator().manual_seed(5)
    if drafter == "repeat":
        for name in list(tensors):
            if name.startswith(mtp) and name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[f"{mtp}eh_proj.weight"] = torch.cat(
            [torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1
        )
        tensors[f"{mtp}shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
        # The target's head leans the same way, so its output repeats often, not always.
        tensors["lm_head.weight"] += tensors["model.embed_tokens.weight"] * REPEAT_LEAN
    else:
        tensors[f"{mtp}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
        head = torch.randn(vocab_size, hidden, generator=gen) * 0.1
        tensors[f"{mtp}shared_head.head.weight"] = head
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = torch.ones(hidden)
    tensors[f"{mtp}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(config))
    return folder
