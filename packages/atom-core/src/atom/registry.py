"""The one registry of supported architectures (docs/architecture.md).

Each entry maps a HF `architectures[0]` name to the ATOM model class (imported lazily)
and declares what the hosts need to know: attention kind, MoE, quantization formats and
which hosts may serve it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

FP8_FORMATS = ("fp8-per-tensor", "fp8-block", "compressed-tensors-fp8")
# 4-bit weight-only (W4A16) dense layers; 4-bit MoE experts are not supported.
W4A16_FORMATS = ("awq", "gptq", "compressed-tensors-w4a16")
QUANT_FORMATS = FP8_FORMATS + W4A16_FORMATS
ALL_HOSTS = ("atom", "vllm", "sglang")


@dataclass(frozen=True)
class ModelEntry:
    architecture: str
    model_module: str  # its module under atom.models, e.g. "llama"
    class_name: str
    family: str
    attention: str = "MHA"  # "MHA" (incl. GQA/MQA), "MLA" or "compressed" (DeepSeek-V4)
    moe: bool = False
    quant: tuple[str, ...] | None = None  # None: QUANT_FORMATS, or FP8_FORMATS for MoE
    hosts: tuple[str, ...] = ALL_HOSTS
    # Keeps per-request state besides the KV cache (Gated DeltaNet layers): hosts must
    # give it their state manager (docs/architecture.md, "Hybrid models").
    hybrid: bool = False
    # Other `architectures` names that checkpoints of this model carry (a release's own
    # name where transformers spells it differently); hosts register them too.
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.architecture, *self.aliases)

    def __post_init__(self) -> None:
        if self.quant is None:
            object.__setattr__(self, "quant", FP8_FORMATS if self.moe else QUANT_FORMATS)

    @property
    def module(self) -> str:
        return f"atom.models.{self.model_module}"

    @property
    def class_path(self) -> str:
        """`module:Class`, the lazy form hosts register."""
        return f"{self.module}:{self.class_name}"

    def load_class(self) -> type:
        # The package spelled out, so the dependency-rule test can read that only ATOM's
        # models load here.
        module = importlib.import_module(f"atom.models.{self.model_module}")
        return getattr(module, self.class_name)


_ENTRIES = (
    ModelEntry("LlamaForCausalLM", "llama", "LlamaForCausalLM", "Llama 2 / 3.x"),
    ModelEntry("Qwen3ForCausalLM", "qwen3", "Qwen3ForCausalLM", "Qwen3"),
    ModelEntry("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", moe=True),
    ModelEntry(
        "MixtralForCausalLM",
        "mixtral",
        "MixtralForCausalLM",
        "Mixtral",
        moe=True,
        hosts=("atom", "vllm"),  # SGLang: not verified on its CPU engine
    ),
    ModelEntry(
        "DeepseekV2ForCausalLM",
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        "DeepSeek-V2",
        attention="MLA",
        moe=True,
    ),
    ModelEntry(
        "DeepseekV3ForCausalLM",
        "deepseek_v2",
        "DeepseekV3ForCausalLM",
        "DeepSeek-V3",
        attention="MLA",
        moe=True,
    ),
    # DeepSeek Sparse Attention (MLA + lightning indexer).
    ModelEntry(
        "DeepseekV32ForCausalLM",
        "deepseek_v32",
        "DeepseekV32ForCausalLM",
        "DeepSeek-V3.2",
        attention="MLA",
        moe=True,
        hosts=("atom", "vllm", "sglang"),
    ),
    ModelEntry(
        "GlmMoeDsaForCausalLM",
        "deepseek_v32",
        "GlmMoeDsaForCausalLM",
        "GLM-5",
        attention="MLA",
        moe=True,
        hosts=("atom", "vllm", "sglang"),
    ),
    # transformers' name; the released checkpoints (Moonshot's remote code) and vLLM's and
    # SGLang's own classes spell it without the underscore.
    ModelEntry(
        "Kimi_K25ForConditionalGeneration",
        "kimi_k25",
        "KimiK25ForCausalLM",
        "Kimi-K2.5 (the text model of the multimodal checkpoints)",
        attention="MLA",
        moe=True,
        hosts=("atom", "vllm", "sglang"),
        aliases=("KimiK25ForConditionalGeneration",),
    ),
    ModelEntry(
        "Glm4MoeForCausalLM",
        "glm4_moe",
        "Glm4MoeForCausalLM",
        "GLM-4.5 / 4.6 / 4.7 (and -Air)",
        moe=True,
    ),
    ModelEntry(
        "GptOssForCausalLM",
        "gpt_oss",
        "GptOssForCausalLM",
        "GPT-OSS (20B / 120B)",
        moe=True,
        quant=("mxfp4 (experts kept packed, dequantized in the MoE kernel)",),
    ),
    # Hybrids of Gated DeltaNet and attention layers (per-request states): the native
    # engine's state cache, vLLM's mamba cache and SGLang's mamba pool. The multimodal
    # checkpoints' names: the native engine only (their vision towers are skipped there).
    ModelEntry(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        "Qwen3NextForCausalLM",
        "Qwen3-Next",
        moe=True,
        hosts=("atom", "vllm", "sglang"),
        hybrid=True,
    ),
    ModelEntry(
        "Qwen3_5ForCausalLM",
        "qwen3_5",
        "Qwen3_5ForCausalLM",
        "Qwen3.5",
        hosts=("atom", "vllm", "sglang"),
        hybrid=True,
    ),
    ModelEntry(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5",
        "Qwen3_5MoeForCausalLM",
        "Qwen3.5-MoE",
        moe=True,
        hosts=("atom", "vllm", "sglang"),
        hybrid=True,
    ),
    ModelEntry(
        "Qwen3_5ForConditionalGeneration",
        "qwen3_5",
        "Qwen3_5ForCausalLM",
        "Qwen3.5 (the text model of the multimodal checkpoints)",
        hosts=("atom",),
        hybrid=True,
    ),
    ModelEntry(
        "Qwen3_5MoeForConditionalGeneration",
        "qwen3_5",
        "Qwen3_5MoeForCausalLM",
        "Qwen3.5-MoE (the text model of the multimodal checkpoints)",
        moe=True,
        hosts=("atom",),
        hybrid=True,
    ),
    # Sliding-window, compressed sparse (CSA) and heavily compressed (HCA) attention,
    # hyper-connections and hash-routed MoE: every host, unquantized or as the releases
    # quantize it.
    ModelEntry(
        "DeepseekV4ForCausalLM",
        "deepseek_v4",
        "DeepseekV4ForCausalLM",
        "DeepSeek-V4",
        attention="compressed",
        moe=True,
        quant=("fp8-block (fp32 or ue8m0 scales) with fp4 (MXFP4) or fp8-block experts",),
        hosts=("atom", "vllm", "sglang"),
    ),
    ModelEntry(
        "MiniMaxM2ForCausalLM",
        "minimax_m2",
        "MiniMaxM2ForCausalLM",
        "MiniMax-M2",
        moe=True,
    ),
)

_BY_ARCH = {name: entry for entry in _ENTRIES for name in entry.names}


class UnsupportedArchitectureError(ValueError):
    pass


def all_models() -> list[ModelEntry]:
    return list(_ENTRIES)


def supported_architectures(host: str | None = None) -> list[str]:
    """Every `architectures` name ATOM runs (on `host`), aliases included."""
    return [name for e in _ENTRIES if host is None or host in e.hosts for name in e.names]


def get_entry(architecture: str) -> ModelEntry:
    try:
        return _BY_ARCH[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported by ATOM; supported: "
            + ", ".join(supported_architectures())
        ) from None


def resolve_model_class(architectures: list[str]) -> tuple[type, ModelEntry]:
    """The ATOM class for the first supported name in a HF `architectures` list."""
    for arch in architectures:
        if arch in _BY_ARCH:
            entry = _BY_ARCH[arch]
            return entry.load_class(), entry
    raise UnsupportedArchitectureError(
        f"architectures {architectures} are not supported by ATOM; supported: "
        + ", ".join(supported_architectures())
    )
