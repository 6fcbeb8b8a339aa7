"""What users of `vllm serve` rely on: /tokenize, /detokenize, /version, X-Request-Id,
--api-key, CORS, --served-model-name, --chat-template, --skip-tokenizer-init, and stop
strings that span token boundaries."""

from __future__ import annotations

import httpx
import openai
import pytest

from atom import SamplingParams
from tests.server.conftest import ENGINE_KWARGS
from tests.server.server_process import MODEL, running_server

API_KEY, ORIGIN, NAME = "s3cret", "http://ui.example", "llama-locked"
# Writes only the contents, so the expected prompt is easy to spell out.
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}river"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def locked_server(checkpoint, tmp_path_factory) -> str:
    """A server with an API key, one CORS origin, its own name and chat template (a file)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    options = {
        "served_model_name": NAME, "log_level": "warning", "api_key": API_KEY,
        "allowed_origins": [ORIGIN], "chat_template": str(template), **ENGINE_KWARGS,
    }  # fmt: skip
    with running_server(str(checkpoint), **options) as url:
        yield url


def test_tokenize_detokenize_and_version(server, offline):
    tokenizer = offline.tokenizer
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens == {"count": 4, "max_model_len": 256, "tokens": tokenizer.encode(PROMPT)}
    messages = [{"role": "user", "content": "a red bird"}]
    chat = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == offline.chat(messages, use_tqdm=False)[0].prompt_token_ids
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": tokenizer.decode(tokens["tokens"])}
    assert httpx.get(f"{server}/version").json() == {"version": "0.1.0"}


def test_request_id_is_echoed(server):
    given = httpx.get(f"{server}/v1/models", headers={"X-Request-Id": "req-42"})
    assert given.headers["x-request-id"] == "req-42"
    fresh = httpx.post(f"{server}/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert len(fresh.headers["x-request-id"]) == 32


def test_api_key_cors_name_and_chat_template(locked_server, offline):
    v1 = f"{locked_server}/v1"
    assert httpx.get(f"{v1}/models").status_code == 401
    wrong = httpx.get(f"{v1}/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{locked_server}/health").status_code == 200
    client = openai.OpenAI(base_url=v1, api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="a")
    content = "a red bird"
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], max_tokens=1
    )
    expected = offline.tokenizer.encode(f"{content} river", add_special_tokens=False)
    assert chat.usage.prompt_tokens == len(expected)

    def preflight(origin: str) -> httpx.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        return httpx.options(f"{v1}/completions", headers=headers)

    assert preflight(ORIGIN).headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_without_a_tokenizer_choices_carry_token_ids(checkpoint, offline):
    prompt = offline.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = offline.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    options = {"served_model_name": MODEL, "log_level": "warning", "skip_tokenizer_init": True}
    with running_server(str(checkpoint), **options, **ENGINE_KWARGS) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        (choice,) = response.choices
        assert (choice.text, choice.token_ids) == ("", expected)
        with pytest.raises(openai.BadRequestError, match="--skip-tokenizer-init"):
            client.completions.create(model=MODEL, prompt=PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_token_boundaries(client, stream):
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "seed": 11}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    # The tail of one word, the space between, the head of the next: three pieces of text
    # that no single token holds.
    stop = f"{words[4][-2:]} {words[5][:2]}"
    expected = full[: full.index(stop)]
    response = client.completions.create(
        **kwargs, stop=stop, stream=stream, extra_body={"ignore_eos": True}
    )
    choices = [c.choices[0] for c in response if c.choices] if stream else response.choices
    assert "".join(c.text for c in choices) == expected
    assert choices[-1].finish_reason == "stop" and choices[-1].stop_reason == stop
