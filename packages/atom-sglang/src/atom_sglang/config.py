"""Config bridge: the HF config ATOM builds its model from, out of SGLang's.

SGLang constructs model classes with its parsed HF config. ATOM's model takes the same
object, except where SGLang's CPU loader changed sizes that the checkpoint's tensors
keep (`atom_model_config`). Features ATOM's wrapper does not implement fail with
`UnsupportedSglangFeature`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from atom.hosts.transformers_config import own_config_class

logger = logging.getLogger("sglang.atom_sglang.config")

# The sizes SGLang's CPU loader (`adjust_config_with_unaligned_cpu_tp`, 0.5.21) rounds up
# to a multiple of tp * 32 for its CPU kernels, keeping the checkpoint's value as
# `original_<name>`. The checkpoint's tensors have the true size, and so must ATOM's
# layers. (It also records `original_num_attention_heads`; head counts are left alone,
# since SGLang sizes its KV pool from the padded ones.)
CPU_PADDED_SIZES = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size_mlp",
)


class UnsupportedSglangFeature(NotImplementedError):
    """An SGLang setting ATOM's wrapper cannot honour (ATOM_DISABLE_SGLANG_PLUGIN=1)."""


def transformers_config(config: Any) -> Any:
    """`config`, or transformers' own class for its model type read from the checkpoint's
    config.json (`atom.hosts.transformers_config`). SGLang 0.5.21-0.5.23 parse DeepSeek-V4
    as a subclass of transformers' DeepseekV3Config (`utils/hf_transformers/common.py`),
    which carries V3's defaults beside the release's fields (e.g. `intermediate_size`
    18432, which transformers' V4 class takes for the experts' size), so it cannot be
    rebuilt from its fields as atom-vllm does with vLLM's class."""
    own = own_config_class(config)
    return config if own is None else own.from_pretrained(config.name_or_path)


def atom_model_config(config: Any) -> Any:
    """The text model's config (a multimodal checkpoint's `text_config`: ATOM runs text
    models) with the checkpoint's sizes where SGLang padded them (`CPU_PADDED_SIZES`);
    that config itself when nothing was padded. A copy, because SGLang's own code (its
    `LogitsProcessor`, MoE set-up) keeps reading the padded one."""
    config = transformers_config(config.get_text_config())
    true_sizes = {
        name: getattr(config, f"original_{name}")
        for name in CPU_PADDED_SIZES
        if getattr(config, f"original_{name}", None) is not None
        and getattr(config, name, None) != getattr(config, f"original_{name}")
    }
    if not true_sizes:
        return config
    restored = copy.deepcopy(config)
    for name, value in true_sizes.items():
        setattr(restored, name, value)
    logger.info("ATOM builds the checkpoint's sizes SGLang padded: %s", true_sizes)
    return restored
