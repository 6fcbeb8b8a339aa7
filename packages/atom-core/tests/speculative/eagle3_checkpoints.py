"""Tiny Llama / Qwen3 targets and EAGLE-3 drafters in their own folders, written here.

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

from atom.testing.tiny_configs import tiny_config, write_checkpoint

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 4, 2, 16, 256, 4


def write_target(architecture: str, folder: Path, lean: float) -> Path:
    config = tiny_config(
        architecture,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=False,
    )
    write_checkpoint(config, folder, init_std=0.1)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] += tensors["model.embed_tokens.weight"] * lean
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def write_drafter(target: Path, folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(9)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    aux = [LAYERS] if kind == "repeat" else None
    draft_vocab = VOCAB if kind == "repeat" else VOCAB // 2
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN),
        "midlayer.post_attention_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, q),
        "midlayer.mlp.gate_proj.weight": rand(96, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(96, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, 96),
        "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": rand(draft_vocab, HIDDEN),
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "t2d": torch.ones(VOCAB, dtype=torch.bool),
    }
    if kind == "repeat":
        target_tensors = load_file(target / "model.safetensors")
        tensors["fc.weight"] = torch.eye(HIDDEN)
        tensors["midlayer.self_attn.o_proj.weight"].zero_()
        tensors["midlayer.mlp.down_proj.weight"].zero_()
        tensors["norm.weight"] = target_tensors["model.norm.weight"].clone()
        tensors["lm_head.weight"] = target_tensors["lm_head.weight"].clone()
    else:
        draft_ids = torch.randperm(VOCAB, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = draft_ids - torch.arange(draft_vocab)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
