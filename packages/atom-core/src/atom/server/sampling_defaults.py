"""`--generation-config`: the sampling defaults a request gets for the fields it leaves out,
as vLLM takes them from the model's `generation_config.json`.

"auto" (the default, as in vLLM) reads the model folder's file, "vllm" uses none (ATOM's
and vLLM's neutral defaults), any other value is a folder holding the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# The generation_config.json keys vLLM takes as request defaults (vLLM 0.32's
# ModelConfig.get_diff_sampling_param); HF's max_new_tokens is a request's max_tokens.
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "max_new_tokens",
)  # fmt: skip


class GenerationConfigError(ValueError):
    pass


def sampling_defaults(generation_config: str, model_folder: str) -> dict:
    """The request defaults `generation_config` ("auto", "vllm" or a folder) gives."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_folder if generation_config == "auto" else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise GenerationConfigError(
                f"--generation-config: no generation_config.json in {folder}"
            )
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(f"{path} is not valid JSON: {exc}") from None
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        logger.info(
            "sampling defaults from %s (requests that leave them out get these): %s",
            path,
            defaults,
        )
    return defaults
