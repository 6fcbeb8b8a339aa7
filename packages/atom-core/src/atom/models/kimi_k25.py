"""Kimi-K2.5's text model: DeepSeek-V3 (MLA, V3 routing) inside a multimodal checkpoint.

The checkpoint (`Kimi_K25ForConditionalGeneration`) nests a DeepSeek-V3 config under
`text_config` (which atom.config reads) and the text weights under `language_model.`
(Moonshot's layout: `language_model.model.layers.*`, `language_model.lm_head.weight`),
or under `model.language_model.` and `lm_head.` as transformers names them. ATOM runs the
text model and skips the vision tower and projector with one log line.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from atom.models.deepseek_v2 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)

# Both spellings of the text model's prefix -> ATOM's.
TEXT_PREFIXES = {"language_model.": "", "model.language_model.": "model."}
SKIPPED_PARTS = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


class KimiK25ForCausalLM(DeepseekV3ForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped: Counter[str] = Counter()

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                part = next((p for p in SKIPPED_PARTS if name.startswith(p)), None)
                if part is not None:
                    skipped[part.removeprefix("model.").rstrip(".")] += 1
                    continue
                prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    name = TEXT_PREFIXES[prefix] + name.removeprefix(prefix)
                yield name, tensor

        loaded = super().load_weights(text_weights())
        if skipped:
            logger.info(
                "%s: skipped the checkpoint's %s (ATOM runs the text model)",
                type(self).__name__,
                ", ".join(f"{part} ({count} tensors)" for part, count in sorted(skipped.items())),
            )
        return loaded
