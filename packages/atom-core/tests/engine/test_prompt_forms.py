"""`LLM.generate` takes vLLM's prompt forms: text, token ids, and the dicts TextPrompt
({"prompt": ...}) and TokensPrompt ({"prompt_token_ids": [...]}), alone or in a list."""

from __future__ import annotations

import pytest

from atom import LLM, SamplingParams
from atom.demo import write_demo_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(str(write_demo_model(tmp_path_factory.mktemp("demo"))), dtype="float32")


def test_vllm_prompt_forms_give_the_same_tokens(llm):
    ids = llm.tokenizer.encode("the quick brown fox")
    expected = llm.generate(ids, GREEDY, use_tqdm=False)[0].token_ids
    forms = ["the quick brown fox", {"prompt": "the quick brown fox"}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [expected] * 3
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.token_ids == expected


def test_a_dict_prompt_names_what_it_lacks(llm):
    with pytest.raises(ValueError, match="exactly one of 'prompt' .* got the keys \\['text'\\]"):
        llm.generate({"text": "a"}, GREEDY, use_tqdm=False)
