"""Every registered architecture has a tiny config (`atom.testing`, the shape the host
suites run), and ATOM's class for it gives HF's logits on that shape."""

from __future__ import annotations

import pytest

from atom.config import ModelConfig
from atom.registry import all_models
from atom.testing import tiny_config
from atom.testing.hf_references import skip_without_hf_reference
from tests.models.harness import check_against_hf, write_checkpoint


@pytest.mark.parametrize("entry", all_models(), ids=lambda entry: entry.architecture)
def test_tiny_config_of_every_registered_architecture_matches_hf(tmp_path, entry):
    skip_without_hf_reference(entry.architecture)
    folder = write_checkpoint(tiny_config(entry.architecture), tmp_path, init_std=0.1)
    assert ModelConfig.from_pretrained(folder).entry == entry
    check_against_hf(folder, prompt_lengths=[5, 17], decode_steps=2)
