"""Tiny Llama / Qwen3 targets and EAGLE-3 drafters in their own folders, for the native
engine's and the vLLM plugin's speculative-decoding tests.

`repeat` drafter: it reads the target's last-layer output (aux layer N), passes it
through (fc the identity, o_proj and down_proj zero) and scores it with the target's own
norm and head: it drafts the token the target just gave, again, which a target whose head
leans towards the embedding often repeats. `random` drafter: random weights, the default
aux layers and a draft vocabulary of half the target's, mapped back by `d2t`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atom.bench.drafter import write_random_eagle3_drafter
from atom.testing.tiny_configs import tiny_config, write_checkpoint

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 4, 2, 16, 256, 4


def write_target(
    architecture: str, folder: Path, lean: float, vocab_size: int = VOCAB, head_dim: int = HEAD_DIM
) -> Path:
    """head_dim: vLLM's CPU attention needs 32 or more."""
    config = tiny_config(
        architecture,
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=head_dim,
        tie_word_embeddings=False,
    )
    write_checkpoint(config, folder, init_std=0.1)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] += tensors["model.embed_tokens.weight"] * lean
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def write_drafter(target: Path, folder: Path, kind: str) -> Path:
    if kind == "random":
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        return write_random_eagle3_drafter(target, folder, vocab // 2, std=0.1, seed=9)
    write_random_eagle3_drafter(target, folder, aux_layer_ids=[LAYERS])
    path = folder / "model.safetensors"
    tensors = load_file(path)
    target_tensors = load_file(target / "model.safetensors")
    tensors["fc.weight"] = torch.eye(HIDDEN)
    tensors["midlayer.self_attn.o_proj.weight"].zero_()
    tensors["midlayer.mlp.down_proj.weight"].zero_()
    tensors["norm.weight"] = target_tensors["model.norm.weight"].clone()
    tensors["lm_head.weight"] = target_tensors["lm_head.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    return folder
