"""A random one-layer EAGLE-3 drafter for a bench shape, written next to its checkpoint.

`atom bench --atom-option speculative_config='{"method": "eagle3", ...}'` without a
"model" gets one (so does `--vllm-option`), shaped as the published drafters are: with
ATOM's `forced_acceptance` (vLLM's synthetic rejection sampling) the mechanism's cost is
then measured at a chosen acceptance, whatever a random drafter would draft.
"""

from __future__ import annotations

import json
from pathlib import Path

# The draft vocabulary of the published EAGLE-3 drafters for Llama-3.1-8B and Qwen3-8B: their
# heads score 32k of the target's tokens. With Qwen3-8B's whole 152k vocabulary the head
# would hold 2.3 times the weights of the drafter's layer and fc together, and dominate
# each draft step.
BENCH_DRAFT_VOCAB = 32_000


def write_random_eagle3_drafter(
    target: Path,
    folder: Path,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    std: float = 0.02,
    seed: int = 0,
) -> Path:
    """A drafter of the target's width, heads and MLP size, in the target's dtype; with
    draft_vocab_size below the target's vocabulary, `d2t` maps a random subset of it (at
    most the whole vocabulary)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = config["intermediate_size"]
    n = config["num_hidden_layers"]
    # EAGLE-3's defaults (layers 2, N/2, N-3) need N >= 5; shallow shapes read 0, N/2, N.
    aux_layer_ids = aux_layer_ids or ([2, n // 2, n - 3] if n >= 5 else [0, n // 2, n])
    draft_vocab = min(draft_vocab_size or vocab, vocab)
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=dtype),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q),
        "midlayer.mlp.gate_proj.weight": rand(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": rand(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, intermediate),
        "norm.weight": torch.ones(hidden, dtype=dtype),
        "lm_head.weight": rand(draft_vocab, hidden),
        "fc.weight": rand(hidden, hidden * len(aux_layer_ids)),
    }
    if draft_vocab != vocab:
        kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = kept - torch.arange(draft_vocab)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    drafter_config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": config.get("max_position_embeddings", 4096),
        "rope_parameters": config.get("rope_parameters")
        or {"rope_type": "default", "rope_theta": 10000.0},
        "dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids},
    }
    (folder / "config.json").write_text(json.dumps(drafter_config, indent=2))
    return folder


def with_random_drafter(model: str, options: dict) -> dict:
    """`options` with an EAGLE-3 speculative_config that names no drafter given one."""
    spec = options.get("speculative_config")
    if not spec or spec.get("method") != "eagle3" or spec.get("model"):
        return options
    folder = Path(model).with_name(Path(model).name + f".eagle3-random-{BENCH_DRAFT_VOCAB}")
    if not (folder / "config.json").exists():
        write_random_eagle3_drafter(Path(model), folder, BENCH_DRAFT_VOCAB)
    return options | {"speculative_config": spec | {"model": str(folder)}}
