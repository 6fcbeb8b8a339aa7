"""transformers' own config class, where a host parses a checkpoint with a class of its own.

ATOM's models (and HF's, the references) read transformers' config class for their model
type. For DeepSeek-V4 the hosts hand over another class: vLLM 0.32 its own
`DeepseekV4Config`, which keeps config.json's fields as they are (the release's names:
`compress_ratios`, `num_hash_layers`, ...); SGLang 0.5.21-0.5.23 a subclass of
transformers' DeepSeek-V3 config, which adds V3's defaults beside them. transformers' own
class turns the release's names into the `layer_types`, `mlp_layer_types`,
`compress_rates` and per-type rope parameters ATOM's model reads. Each plugin rebuilds it
its own way (from the fields, or from the checkpoint), with the class from here.
"""

from __future__ import annotations

from typing import Any

# Model types for which a host's config object may be another class than transformers'.
HOST_PARSED_MODEL_TYPES = ("deepseek_v4",)


def own_config_class(config: Any) -> type | None:
    """transformers' class for `config`'s model type where `config` is a host's other
    class; None where ATOM reads `config` as it is."""
    model_type = getattr(config, "model_type", None)
    if model_type not in HOST_PARSED_MODEL_TYPES:
        return None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # By name from transformers' table: the hosts register their class with AutoConfig.
    own = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    return None if isinstance(config, own) else own
