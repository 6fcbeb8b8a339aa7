"""Tiny HF configs of every architecture the tests use, and random checkpoints of them.

    from atom.testing import tiny_config, write_checkpoint

    config = tiny_config("Qwen3ForCausalLM", tie_word_embeddings=True)
    folder = write_checkpoint(config, tmp_path, init_std=0.1)

The defaults are the smallest shapes that every host runs: two layers, vocab 512, and
head_dim 32 because vLLM's CPU attention needs >= 32. Suites that want other values pass
them as overrides, so every test states what it depends on. `tiny_fields` gives the
plain field dict (no torch, no transformers import) for callers that build the config
themselves, such as `atom.bench` in a torch-free parent process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

_MHA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_QWEN3_MOE = dict(
    _MHA,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
# MLA: kv_lora_rank / qk_*_head_dim / v_head_dim replace head_dim; the first layer is dense.
_MLA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# DeepSeek Sparse Attention: V3's MLA (with q-LoRA, which the indexer reads) and routing,
# plus an indexer of 8 heads that keeps the top 8 tokens, so prompts of 32 and more
# attend sparsely. transformers 5.12 sizes the experts by num_experts.
_DSA = dict(
    _MLA,
    q_lora_rank=48,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    num_experts=_MLA["n_routed_experts"],
    index_topk=8,
    index_n_heads=8,
    index_head_dim=32,
)
# Gated DeltaNet hybrids: three DeltaNet layers, then one full-attention layer (the
# configs' default full_attention_interval of 4); two key heads of four value heads.
_HYBRID = dict(
    _MHA,
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_HYBRID_MOE = dict(
    {k: v for k, v in _HYBRID.items() if k != "intermediate_size"},
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
)
# The released Qwen3.5 checkpoints are multimodal: the text model under text_config, and a
# (here one-block) vision tower.
_QWEN3_5_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=_HYBRID["hidden_size"],
    patch_size=4,
    num_position_embeddings=16,
)
_KIMI_K25_VISION = dict(
    patch_size=4,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=2,
    num_attention_heads=2,
    num_hidden_layers=1,
    hidden_size=32,
    intermediate_size=64,
    merge_kernel_size=[2, 2],
)

# architecture -> (transformers config class, default fields)
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", _MHA),
    "Qwen3ForCausalLM": ("Qwen3Config", _MHA),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", _QWEN3_MOE),
    "MixtralForCausalLM": (
        "MixtralConfig",
        dict(_MHA, num_local_experts=4, num_experts_per_tok=2),
    ),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", _MLA),
    # V3: group-limited routing (4 groups, 2 picked) with a scaling factor.
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        dict(_MLA, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ),
    "DeepseekV32ForCausalLM": ("DeepseekV32Config", _DSA),
    # GLM-5: the second layer reuses the first one's selection.
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", dict(_DSA, indexer_types=["full", "shared"])),
    # Kimi-K2.5: DeepSeek-V3 (with q-LoRA) under text_config, beside a one-block vision
    # tower and its projector.
    "Kimi_K25ForConditionalGeneration": (
        "Kimi_K25Config",
        dict(
            text_config=dict(
                _MLA, model_type="deepseek_v3", q_lora_rank=48, n_group=4, topk_group=2
            ),
            vision_config=_KIMI_K25_VISION,
            projection_hidden_size=32,
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4.x MoE: a dense first layer, then V3 routing (4 groups, 2 picked) with shared
    # experts; q/k/v biases, QK-norm, rotary on half of each head; expert MLPs of 96
    # (no multiple of 64, the usual kernel block).
    "Glm4MoeForCausalLM": (
        "Glm4MoeConfig",
        dict(
            _MHA,
            moe_intermediate_size=96,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    # GPT-OSS: sliding (window 16, so short prompts cross it) and full layers alternating,
    # sinks, biased attention and experts, YaRN whose scaled context is the 512 positions.
    "GptOssForCausalLM": (
        "GptOssConfig",
        dict(
            _MHA,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=8.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
    # MiniMax-M2: every layer sparse (8 experts of 96, top 2) behind a sigmoid router with
    # a correction bias; QK-norm over all heads; rotary on half of each head, named both
    # ways (transformers 5.12 reads only partial_rotary_factor, the hosts' models
    # rotary_dim); bos/eos inside the vocabulary.
    "MiniMaxM2ForCausalLM": (
        "MiniMaxM2Config",
        dict(
            _MHA,
            intermediate_size=96,
            num_local_experts=8,
            num_experts_per_tok=2,
            scoring_func="sigmoid",
            use_routing_bias=True,
            use_qk_norm=True,
            qk_norm_type="per_layer",
            rotary_dim=16,
            partial_rotary_factor=0.5,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "Qwen3NextForCausalLM": (
        "Qwen3NextConfig",
        dict(_HYBRID_MOE, intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[]),
    ),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", _HYBRID),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", _HYBRID_MOE),
    "Qwen3_5ForConditionalGeneration": (
        "Qwen3_5Config",
        dict(text_config=_HYBRID, vision_config=_QWEN3_5_VISION),
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        "Qwen3_5MoeConfig",
        dict(text_config=_HYBRID_MOE, vision_config=_QWEN3_5_VISION),
    ),
    # DeepSeek-V4: one layer of each attention kind (sliding, CSA, HCA), the first MoE
    # layer hash-routed; CSA compresses 4 tokens and keeps the top 4 entries, HCA compresses
    # 16; a window of 16, so prompts of 40 and more see all three at work.
    "DeepseekV4ForCausalLM": (
        "DeepseekV4Config",
        dict(
            vocab_size=512,
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            head_dim=32,
            partial_rotary_factor=0.5,
            q_lora_rank=48,
            o_groups=2,
            o_lora_rank=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            hc_mult=4,
            sliding_window=16,
            index_n_heads=8,
            index_head_dim=32,
            index_topk=4,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # An architecture ATOM does not implement: the hosts' fall-back path.
    "GPT2LMHeadModel": (
        "GPT2Config",
        dict(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=512),
    ),
}

# DeepSeek's YaRN with mscale (V3 checkpoints); a rope_parameters override.
DEEPSEEK_YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def _entry(architecture: str) -> tuple[str, dict[str, Any]]:
    try:
        return _ARCHITECTURES[architecture]
    except KeyError:
        known = ", ".join(_ARCHITECTURES)
        raise KeyError(f"no tiny config for {architecture!r}; known: {known}") from None


def config_class_name(architecture: str) -> str:
    """The transformers config class of `architecture`, e.g. "Qwen3Config"."""
    return _entry(architecture)[0]


def tiny_fields(architecture: str, **overrides: Any) -> dict[str, Any]:
    """The config fields of a tiny `architecture` (without `architectures`), overridden."""
    fields = {name: _copy(value) for name, value in _entry(architecture)[1].items()}
    fields.update(overrides)
    return fields


def tiny_config(architecture: str, **overrides: Any):
    """A tiny random-model HF config of `architecture` (`architectures` set), overridden."""
    import transformers

    config_class = getattr(transformers, config_class_name(architecture))
    return config_class(**tiny_fields(architecture, **overrides), architectures=[architecture])


def write_checkpoint(
    config,
    folder: str | Path,
    seed: int = 0,
    dtype=None,
    init_std: float | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Saves a random HF model of `config` as safetensors + config.json in `folder`.

    `dtype` defaults to float32. `init_std` redraws every matrix from N(0, init_std):
    weights larger than HF's 0.02 make greedy choices decisive (fewer near-ties in the
    logits). `max_shard_size` (e.g. "100KB") writes a sharded checkpoint.
    """
    import torch
    import transformers

    dtype = torch.float32 if dtype is None else dtype
    torch.manual_seed(seed)
    config.dtype = dtype
    # A multimodal config (Qwen3.5's) is saved whole, vision tower included.
    auto = getattr(config, "vision_config", None) and transformers.AutoModelForImageTextToText
    model = (auto or transformers.AutoModelForCausalLM).from_config(config, dtype=dtype)
    if init_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, init_std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if config.model_type in RELEASED_NAMES:
        _rename_tensors(Path(folder), *RELEASED_NAMES[config.model_type])
    return Path(folder)


# transformers saves some models under names their released checkpoints do not use:
# model_type -> (saved prefix, released prefix). Kimi-K2.5: transformers renames the
# vision tower's "blocks" to "layers" on load and back on save, the text model's too.
RELEASED_NAMES = {"kimi_k25": ("language_model.model.blocks.", "language_model.model.layers.")}


def _rename_tensors(folder: Path, old: str, new: str) -> None:
    import json

    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = {name.replace(old, new, 1): t for name, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k.replace(old, new, 1): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


# The host-plugin suites also exercise DeepSeek-V3's q-LoRA and YaRN with mscale.
HOST_SUITE_OVERRIDES = {
    "DeepseekV3ForCausalLM": dict(q_lora_rank=48, rope_parameters=DEEPSEEK_YARN_ROPE),
}


def write_host_checkpoint(
    architecture: str, folder: str | Path, seed: int = 0, init_std: float = 0.1
) -> Path:
    """The random fp32 checkpoint of `architecture` that the vLLM and SGLang suites run:
    the tiny shape (head_dim 32: vLLM's CPU attention needs >= 32) with the host-suite
    overrides; weights of std 0.1 rather than HF's 0.02 give fewer near-ties."""
    config = tiny_config(architecture, **HOST_SUITE_OVERRIDES.get(architecture, {}))
    folder = write_checkpoint(config, folder, seed=seed, init_std=init_std)
    if config.model_type == "deepseek_v4":  # as its model suite's checkpoints
        from atom.testing.trained_look import draw_hash_tables, randomize_vectors

        randomize_vectors(folder)
        draw_hash_tables(folder, config.n_routed_experts)
        release_deepseek_v4_config(folder)
    return folder


# DeepSeek-V4's released config.json gives each layer's compress ratio (0: sliding; the
# CSA and HCA ratios 4 and 128, `compress_rate_csa` / `_hca` overriding the value) where
# transformers writes `layer_types` and `compress_rates`.
_RELEASED_V4_RATIOS = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


def release_deepseek_v4_config(folder: str | Path) -> None:
    """Rewrites a transformers-written DeepSeek-V4 config.json in the release's names,
    which transformers' config also reads (and vLLM 0.32's own config class parses,
    while it refuses transformers' `mlp_layer_types`): `compress_ratios` per layer,
    `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers` (hash-routed layers
    first), `rope_theta` / `compress_rope_theta` for the two ropes' plain parameters."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    rates = config.pop("compress_rates")
    config["compress_ratios"] = [_RELEASED_V4_RATIOS[t] for t in config.pop("layer_types")]
    config["compress_rate_csa"] = rates["compressed_sparse_attention"]
    config["compress_rate_hca"] = rates["heavily_compressed_attention"]
    mlp = config.pop("mlp_layer_types")
    hashed = mlp.count("hash_moe")
    if mlp != ["hash_moe"] * hashed + ["moe"] * (len(mlp) - hashed):
        raise ValueError(f"the release's names put hash-routed layers first, not {mlp}")
    config["num_hash_layers"] = hashed
    rope = config.pop("rope_parameters")
    for name, field in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
        if rope[name].get("rope_type", "default") != "default":
            raise ValueError(f"release_deepseek_v4_config writes plain ropes, not {rope[name]}")
        config[field] = rope[name]["rope_theta"]
    path.write_text(json.dumps(config, indent=2))


def host_checkpoints(root: Path) -> Callable[[str], Path]:
    """architecture -> its `write_host_checkpoint` folder under `root`, written on first use."""
    made: dict[str, Path] = {}

    def get(architecture: str) -> Path:
        if architecture not in made:
            made[architecture] = write_host_checkpoint(architecture, root / architecture)
        return made[architecture]

    return get


def _copy(value: Any) -> Any:
    # Lists and dicts in the defaults must not be shared between configs.
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value
