"""Speculative decoding with an EAGLE-3 drafter from its own folder gives the target's
greedy output token for token (chunked prefill, prefix hits and preemption in the run),
and bad drafters fail before any weight loads."""

from __future__ import annotations

import json

import pytest

from atom import LLM
from atom.config import ConfigError
from atom.testing.eagle3_checkpoints import write_drafter, write_target
from tests.speculative.workload import run


def eagle3(drafter) -> dict:
    return {"method": "eagle3", "num_speculative_tokens": 3, "model": str(drafter)}


@pytest.mark.parametrize(
    ("architecture", "kind"), [("LlamaForCausalLM", "repeat"), ("Qwen3ForCausalLM", "random")]
)
def test_greedy_output_is_the_targets(tmp_path, architecture, kind):
    target = write_target(architecture, tmp_path / "target", lean=1.0)
    drafter = write_drafter(target, tmp_path / "drafter", kind)
    common = dict(model=str(target), dtype="float32", skip_tokenizer_init=True)
    expected = run(LLM(**common))
    llm = LLM(
        **common,
        speculative_config=eagle3(drafter),
        max_num_batched_tokens=16,
        num_blocks=18,
        block_size=4,
    )
    assert run(llm) == expected
    assert run(llm) == expected  # from the prefix cache
    stats, spec = llm.engine.stats(), llm.engine.spec_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks
    if kind == "repeat":
        assert spec.acceptance_rate > 0.1 and spec.accepted_per_position[-1] > 0, spec
    else:
        assert spec.num_draft_tokens > 0 and spec.acceptance_rate < 0.1, spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 300}, "EAGLE-3 drafter vocab_size 300 differs from the target's 256"),
        ({"hidden_size": 32}, "reads hidden states of width 32; the target's are 64"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 9]}},
            "reads target layers [1, 9]; the target has 4",
        ),
    ],
)
def test_a_drafter_that_does_not_fit_the_target(tmp_path, change, message):
    target = write_target("LlamaForCausalLM", tmp_path / "target", lean=0.0)
    drafter = write_drafter(target, tmp_path / "drafter", "random")
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as error:
        LLM(model=str(target), skip_tokenizer_init=True, speculative_config=eagle3(drafter))
    assert message in str(error.value)


def test_eagle3_needs_its_folder(tmp_path):
    with pytest.raises(ConfigError, match="'eagle3' needs 'model'"):
        LLM(
            model=str(tmp_path),
            speculative_config={"method": "eagle3", "num_speculative_tokens": 2},
        )
