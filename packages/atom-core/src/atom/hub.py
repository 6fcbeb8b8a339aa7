"""A model given as a Hugging Face hub id (`Qwen/Qwen3-0.6B`) instead of a folder: resolved
through huggingface_hub's cache, as vLLM and transformers do.

The cache is read first, so a model downloaded once serves with no network (and with
HF_HUB_OFFLINE=1 only the cache is read); otherwise the snapshot is downloaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from atom.config import ConfigError

logger = logging.getLogger(__name__)


def resolve_model_path(model: str) -> str:
    """`model` itself when it is a local path; else the cached (or downloaded) snapshot
    folder of the hub repository it names."""
    if Path(model).exists() or not _looks_like_repo_id(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as exc:
        raise ConfigError(f"{model!r} is neither a folder nor a hub repository id: {exc}") from None
    try:
        logger.info("downloading %s from the Hugging Face hub", model)
        return snapshot_download(model)
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{model!r} is not a local folder and not in the Hugging Face cache, and the hub "
            "cannot be reached (or HF_HUB_OFFLINE is set)"
        ) from None
    except Exception as exc:  # the hub's HTTP, auth and not-found errors
        raise ConfigError(f"cannot fetch {model!r} from the Hugging Face hub: {exc}") from None


def _looks_like_repo_id(model: str) -> bool:
    # `org/name` or `name`; a path with more parts, or starting with . / ~, is a folder.
    return model.count("/") <= 1 and not model.startswith((".", "/", "~"))
