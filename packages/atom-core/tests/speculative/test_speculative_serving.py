"""`atom generate` and `atom serve` with --speculative-config: the target's greedy text,
and the drafts counted on /metrics."""

from __future__ import annotations

import httpx
import pytest

from atom import LLM, SamplingParams
from atom.cli import main
from atom.testing.mtp_checkpoints import write_mtp_checkpoint
from tests.server.byte_level_model import VOCAB_SIZE, build_tokenizer
from tests.server.server_process import MODEL, running_server, scrape_metrics

SPEC = {"method": "mtp", "num_speculative_tokens": 3}
PROMPT = "The quick brown fox jumps"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = write_mtp_checkpoint(
        "glm-4.5", tmp_path_factory.mktemp("glm-mtp"), "repeat", vocab_size=VOCAB_SIZE
    )
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def expected(folder) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    llm = LLM(model=str(folder), dtype="float32")
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_generate_command(folder, expected, capsys):
    main(
        [
            "generate", str(folder), "--dtype", "float32", "--prompt", PROMPT,
            "--max-tokens", str(MAX_TOKENS),
            "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
        ]
    )  # fmt: skip
    assert capsys.readouterr().out.splitlines() == [expected]


def test_a_bad_speculative_config_flag_names_it(folder, capsys):
    with pytest.raises(SystemExit):
        main(["generate", str(folder), "--prompt", "x", "--speculative-config", "{mtp"])
    assert "--speculative-config: not valid JSON" in capsys.readouterr().err


def test_server(folder, expected):
    options = {"served_model_name": MODEL, "log_level": "warning", "dtype": "float32"}
    with running_server(str(folder), **options, speculative_config=SPEC) as url:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.json()["choices"][0]["text"] == expected
        metrics = scrape_metrics(url)
    assert metrics["atom:spec_decode_num_draft_tokens_total"] > 0
    assert metrics["atom:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics['atom:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
