"""Kimi-K2.5's text model (DeepSeek-V3 in a multimodal checkpoint) against HF transformers."""

from __future__ import annotations

import logging

from atom.testing import tiny_config, write_checkpoint
from atom.testing.hf_references import skip_without_hf_reference
from tests.models.harness import check_against_hf

ARCHITECTURE = "Kimi_K25ForConditionalGeneration"


def test_text_model_matches_hf_and_skips_the_vision_parts(tmp_path, caplog):
    skip_without_hf_reference(ARCHITECTURE)
    folder = write_checkpoint(tiny_config(ARCHITECTURE), tmp_path, init_std=0.1)
    with caplog.at_level(logging.INFO, logger="atom.models.kimi_k25"):
        check_against_hf(folder, prompt_lengths=[7, 33], decode_steps=3)
    (line,) = [
        r.getMessage() for r in caplog.records if "ATOM runs the text model" in r.getMessage()
    ]
    assert line.startswith("KimiK25ForCausalLM: skipped the checkpoint's mm_projector (")
    assert "vision_tower (" in line
