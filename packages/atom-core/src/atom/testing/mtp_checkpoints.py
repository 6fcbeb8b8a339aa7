"""Tiny DeepSeek-V3, GLM-4.5 and Qwen3-Next checkpoints with an MTP layer, for the native
engine's and the host plugins' speculative-decoding tests.

HF transformers does not run MTP layers, so these are built from a checkpoint of one
more decoder layer: its last layer becomes the MTP layer's decoder block, and enorm,
hnorm, eh_proj and the shared head are added. Two drafters: `random` (its drafts are
almost never the target's: every step rejects) and `repeat`, whose eh_proj passes the
next token's embedding through, whose block adds nothing (o_proj and down projections
zero) and whose head is the embedding matrix: it drafts the token it reads again, which
a random target's repetitive output often accepts. Qwen3-Next's module (`mtp.*`) has fc
and its norms in place of eh_proj, enorm and hnorm, and reads the target's head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atom.testing.tiny_configs import tiny_config, write_checkpoint

# How far the target's head leans towards the embedding (see `repeat` above): enough for
# a third or more of a random target's tokens to repeat.
REPEAT_LEAN = {"deepseek-v3.2": 2.0, "glm-5": 2.0}
QWEN3_NEXT_EMBED_SCALE = 4.0
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_nextn_predict_layers=1)
# Families whose MTP layers are an `mtp.*` module (atom.speculative.qwen3_next_mtp).
MTP_MODULE_FAMILIES = {"qwen3-next": "Qwen3NextForCausalLM", "qwen3.5-moe": "Qwen3_5MoeForCausalLM"}
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
    "deepseek-v3.2": lambda layers: tiny_config(
        "DeepseekV32ForCausalLM",
        **SMALL,
        num_hidden_layers=layers,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "glm-5": lambda layers: tiny_config(
        "GlmMoeDsaForCausalLM",
        **SMALL,
        num_hidden_layers=layers,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        indexer_types=["full", "shared", "full"][:layers],
    ),
}


def write_mtp_checkpoint(
    family: str, folder: Path, drafter: str, num_layers: int = 2, vocab_size: int = 256
) -> Path:
    if family in MTP_MODULE_FAMILIES:
        return _write_mtp_module(MTP_MODULE_FAMILIES[family], folder, drafter, vocab_size)
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
        lean = REPEAT_LEAN.get(family, 1.0)
        tensors["lm_head.weight"] += tensors["model.embed_tokens.weight"] * lean
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
    for per_layer in ("layer_types", "mlp_layer_types", "indexer_types"):
        if isinstance(config.get(per_layer), list):
            config[per_layer] = config[per_layer][:num_layers]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _write_mtp_module(architecture: str, folder: Path, drafter: str, vocab_size: int) -> Path:
    """Three DeltaNet layers and a gated-attention layer, then the MTP module, whose
    layer is built as one more full-attention layer of the checkpoint."""
    layer_types = ["linear_attention"] * 3 + ["full_attention"] * 2
    config = tiny_config(
        architecture, num_hidden_layers=5, layer_types=layer_types, vocab_size=vocab_size
    )
    write_checkpoint(config, folder, init_std=0.1)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.startswith("model.layers.4.")]:
        tensors["mtp.layers.0." + name.removeprefix("model.layers.4.")] = tensors.pop(name)
    hidden = config.hidden_size
    if drafter == "repeat":
        for name in tensors:
            if name.startswith("mtp.layers.") and ("o_proj" in name or "down_proj" in name):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        # A larger embedding leads the target's residual stream, so that with the lean
        # head its output repeats often.
        tensors["model.embed_tokens.weight"] *= QWEN3_NEXT_EMBED_SCALE
        tensors["lm_head.weight"] += tensors["model.embed_tokens.weight"]
    else:
        gen = torch.Generator().manual_seed(5)
        tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(hidden)  # zero-centred: a scale of 1
    save_file(tensors, path, metadata={"format": "pt"})
    saved = json.loads((folder / "config.json").read_text())
    saved["num_hidden_layers"], saved["layer_types"] = 4, layer_types[:4]
    (folder / "config.json").write_text(json.dumps(saved))
    return folder
