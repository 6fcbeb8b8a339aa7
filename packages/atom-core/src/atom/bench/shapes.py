"""Model shapes for random-weight checkpoints, and where their checkpoints are cached.

A shape is a transformers config (class name + fields). `NAME:LAYERS` overrides the
layer count, e.g. `qwen3-30b-a3b:24` when the full depth does not fit the GPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from atom.bench.workloads import BenchError
from atom.registry import all_models
from atom.testing import config_class_name, tiny_fields

DEFAULT_SHAPES = "qwen3-0.6b,qwen3-8b,qwen3-30b-a3b:24"

_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000,
    rms_norm_eps=1e-6,
)

# What DeepSeek-V3.2 and Kimi-K2.5 keep from DeepSeek-V3's released config.
_DEEPSEEK_V3_COMMON = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_shared_experts=1,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@dataclass(frozen=True)
class Shape:
    name: str
    config_class: str  # a transformers config class
    architecture: str
    fields: dict = field(hash=False)
    quantization: str | None = None  # atom.bench.quantize's methods; None: bf16

    @property
    def num_layers(self) -> int:
        return self.fields["num_hidden_layers"]

    @property
    def vocab_size(self) -> int:
        return self.fields["vocab_size"]

    def cache_folder(self, root: Path) -> Path:
        """A folder per distinct config, so a changed shape never reuses a stale checkpoint."""
        key = [self.config_class, self.architecture, self.fields]
        if self.quantization:
            key.append(self.quantization)
        key = json.dumps(key, sort_keys=True)
        return (
            root / f"{self.name.replace(':', '-L')}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        )


SHAPES = {
    "qwen3-0.6b": Shape(
        "qwen3-0.6b",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            _QWEN3_COMMON,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": Shape(
        "qwen3-8b",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            _QWEN3_COMMON,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": Shape(
        "qwen3-30b-a3b",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _QWEN3_COMMON,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4.5-Air: 128 routed experts (top 8) + 1 shared, first layer dense, q/k/v bias,
    # rotary on half of each head.
    "glm-4.5-air": Shape(
        "glm-4.5-air",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            vocab_size=151552,
            hidden_size=4096,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=46,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            attention_bias=True,
            use_qk_norm=False,
            partial_rotary_factor=0.5,
            n_routed_experts=128,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    # gpt-oss-20b with bf16 experts (the release ships them as MXFP4): 32 experts (top 4)
    # with biases and the clamped SwiGLU, attention sinks, 128-token sliding-window and
    # full layers alternating, YaRN.
    "gpt-oss-20b": Shape(
        "gpt-oss-20b",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            attention_bias=True,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    # MiniMax-M2 (230B total, 10B active): 256 experts (top 8) in every layer behind a
    # sigmoid router with a correction bias, QK-norm over all heads, rotary on half of each
    # head (named both ways, as the tiny config explains).
    "minimax-m2": Shape(
        "minimax-m2",
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            vocab_size=200064,
            hidden_size=3072,
            intermediate_size=1536,
            num_hidden_layers=62,
            num_attention_heads=48,
            num_key_value_heads=8,
            head_dim=128,
            rotary_dim=64,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            qk_norm_type="per_layer",
            num_local_experts=256,
            num_experts_per_tok=8,
            scoring_func="sigmoid",
            use_routing_bias=True,
            max_position_embeddings=196608,
            rope_theta=5000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-Next-80B-A3B: three Gated DeltaNet layers to each gated full-attention layer
    # (the config's default layer_types, which follow the depth), 512 experts (top 10)
    # + a shared expert. `qwen3-next-80b-a3b:8` (two attention layers) fits one H100.
    "qwen3-next-80b-a3b": Shape(
        "qwen3-next-80b-a3b",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5120,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            full_attention_interval=4,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=262144,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
            },
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # MLA (512-wide latent cache), 64 routed + 2 shared experts, first layer dense.
    "deepseek-v2-lite": Shape(
        "deepseek-v2-lite",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            # As the released config says (transformers' DeepseekV2Config has no such
            # fields): vLLM's DeepSeek needs the groups, SGLang's reads moe_layer_freq
            # and scoring_func.
            n_group=1,
            topk_group=1,
            moe_layer_freq=1,
            scoring_func="softmax",
            first_k_dense_replace=1,
            norm_topk_prob=False,
            topk_method="greedy",
            routed_scaling_factor=1.0,
            max_position_embeddings=163840,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (a 64-head indexer of
    # 128 channels keeps the top 2048 tokens per query), YaRN as released. Every MoE layer
    # holds 22.5 GB of bf16 experts: `deepseek-v3.2:5` (3 dense + 2 MoE layers, 53 GB of
    # weights) fits one H100.
    "deepseek-v3.2": Shape(
        "deepseek-v3.2",
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            _DEEPSEEK_V3_COMMON,
            vocab_size=129280,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            first_k_dense_replace=3,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            index_topk=2048,
            index_n_heads=64,
            index_head_dim=128,
            max_position_embeddings=163840,
            rope_parameters=dict(_DEEPSEEK_YARN, factor=40.0),
            rms_norm_eps=1e-6,
        ),
    ),
    # GLM-5 (GLM-MoE-DSA): DSA with a 32-head indexer whose rope pairs interleaved
    # channels, wider heads (nope 192, v 256), 256 experts (top 8). `glm-5:5` (3 dense +
    # 2 MoE layers, 46 GB) fits one H100.
    "glm-5": Shape(
        "glm-5",
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            vocab_size=154880,
            hidden_size=6144,
            intermediate_size=12288,
            moe_intermediate_size=2048,
            num_hidden_layers=78,
            num_attention_heads=64,
            num_key_value_heads=64,
            q_lora_rank=2048,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            index_topk=2048,
            index_n_heads=32,
            index_head_dim=128,
            max_position_embeddings=202752,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    # Kimi-K2.5's text model (the speed of a step does not depend on the vision tower, so
    # the shape is the DeepSeek-V3 text config its release nests): 64 heads, 384 experts
    # (top 8), one dense layer. Every MoE layer holds 34 GB of bf16 experts:
    # `kimi-k2.5:2` (1 dense + 1 MoE layer, 40 GB) fits one H100.
    "kimi-k2.5": Shape(
        "kimi-k2.5",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _DEEPSEEK_V3_COMMON,
            vocab_size=163840,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_routed_experts=384,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            max_position_embeddings=262144,
            rope_parameters=dict(_DEEPSEEK_YARN, rope_theta=50000.0, factor=64.0),
            rms_norm_eps=1e-5,
        ),
    ),
    # DeepSeek-V4-Flash, as `DeepseekV4Config`'s defaults give it (spelled out, so a new
    # transformers default cannot change the shape): compressed sparse attention (entries
    # of 4 tokens, a 64-head indexer keeps 512) and heavily compressed attention (entries
    # of 128) layers beside a 128-token window, one 512-wide K = V head, hyper-connections
    # over 4 streams, hash-routed MoE in the first 3 layers. Every MoE layer holds 12.9 GB
    # of bf16 experts (the release keeps them in FP4): `deepseek-v4-flash:4` (3 hash-routed
    # and 1 routed MoE layer, 54 GB) fits one H100.
    "deepseek-v4-flash": Shape(
        "deepseek-v4-flash",
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            vocab_size=129280,
            hidden_size=4096,
            num_hidden_layers=43,
            num_attention_heads=64,
            num_key_value_heads=1,
            head_dim=512,
            qk_rope_head_dim=64,
            q_lora_rank=1024,
            o_lora_rank=1024,
            o_groups=8,
            sliding_window=128,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            index_topk=512,
            index_n_heads=64,
            index_head_dim=128,
            hc_mult=4,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=6,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            swiglu_limit=10.0,
            max_position_embeddings=1048576,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # For tests and CPU smoke runs; tiny-gpt-oss has a 16-token window.
    "tiny-gpt-oss": Shape(
        "tiny-gpt-oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        tiny_fields("GptOssForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=48),
    ),
    "tiny": Shape(
        "tiny",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        tiny_fields(
            "Qwen3ForCausalLM",
            hidden_size=64,
            intermediate_size=128,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        ),
    ),
}


def _tiny_shape(architecture: str, hybrid: bool) -> Shape:
    fields = tiny_fields(architecture)
    if hybrid:
        # HF's default pattern (every 4th layer full attention), written out: SGLang reads
        # the interval from config.json, not the layer types HF derives.
        fields["full_attention_interval"] = 4
    return Shape(f"tiny-{architecture}", config_class_name(architecture), architecture, fields)


# A tiny shape of every registered causal LM (atom.testing's configs, the host suites'):
# `atom bench check --device cpu` runs each family through every host with them.
SHAPES |= {
    f"tiny-{entry.architecture}": _tiny_shape(entry.architecture, entry.hybrid)
    for entry in all_models()
    if entry.architecture.endswith("ForCausalLM")
}


def parse_shapes(text: str, quantization: str | None = None) -> list[Shape]:
    """`NAME[:LAYERS],...`; with `quantization`, each shape's checkpoint is quantized and
    its name says so (`qwen3-8b:8+gptq`)."""
    shapes = []
    for item in (x.strip() for x in text.split(",")):
        name, _, layers = item.partition(":")
        if name not in SHAPES:
            raise BenchError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[name]
        if layers:
            if not layers.isdigit() or int(layers) < 1:
                raise BenchError(f"shape {item!r}: the layer count after ':' must be >= 1")
            fields = dict(shape.fields, num_hidden_layers=int(layers))
            shape = Shape(item, shape.config_class, shape.architecture, fields)
        if quantization:
            shape = replace(shape, name=f"{shape.name}+{quantization}", quantization=quantization)
        shapes.append(shape)
    if len({s.name for s in shapes}) != len(shapes):
        raise BenchError(f"shapes {text!r} repeat one")
    return shapes
