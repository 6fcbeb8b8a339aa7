"""Whether the installed transformers can be the reference of an architecture.

ATOM declares a transformers range (CI runs both ends); the newest families are missing
from its older end, or were first written there with another detail. Tests that compare
with HF ask here and skip with the reason.
"""

from __future__ import annotations

import importlib
import inspect


def _module(name: str):
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None


def _glm_moe_dsa_problem() -> str | None:
    glm = _module("glm_moe_dsa")
    if glm is None:
        return "this transformers has no GLM-MoE-DSA (transformers.models.glm_moe_dsa)"
    # GLM-5's reference (and transformers from 5.2x) rotates interleaved pairs in the
    # indexer; earlier releases copied DeepSeek-V3.2's indexer whole.
    source = inspect.getsource(glm.GlmMoeDsaIndexer.forward)
    if "apply_rotary_pos_emb_interleave" not in source:
        return "this transformers' GLM-MoE-DSA indexer uses DeepSeek-V3.2's half-split rope"
    return None


def hf_reference_problem(architecture: str) -> str | None:
    """Why the installed transformers cannot check `architecture`, or None."""
    if architecture == "DeepseekV32ForCausalLM" and _module("deepseek_v32") is None:
        return "this transformers has no DeepSeek-V3.2 (transformers.models.deepseek_v32)"
    if architecture == "GlmMoeDsaForCausalLM":
        return _glm_moe_dsa_problem()
    if architecture == "Kimi_K25ForConditionalGeneration" and _module("kimi_k25") is None:
        return "this transformers has no Kimi-K2.5 (transformers.models.kimi_k25)"
    return None


def skip_without_hf_reference(architecture: str) -> None:
    """Skips the calling test (or fixture) where the installed transformers cannot check
    `architecture`, saying why."""
    problem = hf_reference_problem(architecture)
    if problem is not None:
        import pytest

        pytest.skip(problem)


def hf_causal_lm_class(model_dir: str):
    """The transformers Auto class that runs a checkpoint on text prompts: the causal LM,
    or the whole multimodal model where its config has no causal-LM class (Kimi-K2.5)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    if type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText
