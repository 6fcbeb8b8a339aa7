"""Bad speculative settings fail with one clear error before any weight loads."""

from __future__ import annotations

import json

import pytest

from atom import LLM
from atom.config import ConfigError
from atom.testing.mtp_checkpoints import CONFIGS, write_mtp_checkpoint
from atom.testing.tiny_configs import tiny_config, write_checkpoint

MTP = {"method": "mtp", "num_speculative_tokens": 2}


def start(folder, spec) -> LLM:
    return LLM(model=str(folder), skip_tokenizer_init=True, speculative_config=spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"method": "eagle9", "num_speculative_tokens": 2},
            "speculative method 'eagle9' is not supported",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer >= 1",
        ),
        ({"method": "mtp"}, "needs 'method' and 'num_speculative_tokens'"),
        ({**MTP, "draft_model": "x"}, "unknown field(s) ['draft_model']"),
        ({**MTP, "forced_acceptance": 1.5}, "forced_acceptance must be in [0, 1]"),
    ],
)
def test_bad_settings(tmp_path, spec, message):
    with pytest.raises(ConfigError) as error:
        start(tmp_path, spec)  # fails before the folder is even read
    assert message in str(error.value)


def test_a_model_without_mtp_support(tmp_path):
    folder = write_checkpoint(tiny_config("Qwen3ForCausalLM"), tmp_path)
    with pytest.raises(ConfigError, match="'mtp' is not supported for Qwen3ForCausalLM"):
        start(folder, MTP)


def test_a_checkpoint_without_mtp_weights(tmp_path):
    write_checkpoint(CONFIGS["deepseek-v3"](2), tmp_path / "deepseek")
    with pytest.raises(ConfigError, match=r"no MTP weights \(model.layers.2.eh_proj.weight"):
        start(tmp_path / "deepseek", MTP)
    write_checkpoint(tiny_config("Qwen3NextForCausalLM"), tmp_path / "qwen3-next")
    with pytest.raises(ConfigError, match=r"no MTP weights \(mtp.fc.weight is missing"):
        start(tmp_path / "qwen3-next", MTP)


def test_a_config_without_mtp_layers(tmp_path):
    folder = write_mtp_checkpoint("glm-4.5", tmp_path, "random")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="needs MTP layers, but num_nextn_predict_layers is 0"):
        start(folder, MTP)
