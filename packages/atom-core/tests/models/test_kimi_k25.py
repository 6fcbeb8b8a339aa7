"""Kimi-K2.5's text model (DeepSeek-V3 in a multimodal checkpoint) against HF transformers."""

from __future__ import annotations

import logging

from atom.registry import all_models, get_entry, resolve_model_class, supported_architectures
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


def test_released_checkpoints_name_is_the_same_entry():
    """Moonshot's checkpoints (and vLLM's / SGLang's classes) say
    KimiK25ForConditionalGeneration; transformers says Kimi_K25ForConditionalGeneration."""
    released = "KimiK25ForConditionalGeneration"
    entry = get_entry(ARCHITECTURE)
    assert get_entry(released) is entry and released in entry.names
    assert resolve_model_class([released])[1] is entry
    for host in entry.hosts:
        assert {ARCHITECTURE, released} <= set(supported_architectures(host))
    assert len(all_models()) == len({e.architecture for e in all_models()})
