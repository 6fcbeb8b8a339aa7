"""200 mixed requests at once against one server: completions and chat, streamed and not,
some abandoned mid-stream, some invalid. Every valid one gets the offline engine's greedy
text, every invalid one its 4xx with an OpenAI-style error, the abandoned ones free their
KV blocks, and the server serves on."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai

from atom import SamplingParams
from atom.demo import WORDS
from tests.server.server_process import MODEL, scrape_metrics, wait_until_idle

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
KINDS = ("completion", "streamed completion", "chat", "streamed chat")
NUM_VALID_PER_KIND, NUM_LEAVING, NUM_INVALID = 30, 40, 40  # 200 in all
MAX_TOKENS, LEAVING_MAX_TOKENS = 8, 200  # a leaving client's request would run long
CHUNKS_BEFORE_LEAVING = 3
PROMPTS = [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(3 + i)) for i in range(10)]
HI = [{"role": "user", "content": "hi"}]
# (path, body, status, the field the error names)
INVALID = [
    (COMPLETIONS, {"prompt": "a", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "temprature": 0}, 400, "temprature"),
    (COMPLETIONS, {"prompt": [5] * 300}, 400, "prompt"),
    (CHAT, {"messages": HI, "presence_penalty": -3}, 400, "presence_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": "a", "x": 1}]}, 400, "messages.0.x"),
    (CHAT, {"messages": HI, "n": 10**9}, 400, "n"),
    (CHAT, {"model": "gpt-9", "messages": HI}, 404, "model"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
]
SUCCEEDED = ('atom:request_success_total{finished_reason="stop"}',
             'atom:request_success_total{finished_reason="length"}')  # fmt: skip
ABORTED = 'atom:request_success_total{finished_reason="abort"}'


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def test_mixed_load_on_one_server(server, offline):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    conversations = [messages(prompt) for prompt in PROMPTS]
    expected = {
        "completion": [o.outputs[0].text for o in offline.generate(PROMPTS, greedy, False)],
        "chat": [o.outputs[0].text for o in offline.chat(conversations, greedy, False)],
    }
    before = wait_until_idle(server)
    valid, leaving, invalid = asyncio.run(asyncio.wait_for(drive(server), timeout=120))
    after = wait_until_idle(server)  # every KV block free again, aborted ones' too

    for kind, prompt_index, text, finish_reason in valid:
        reference = expected[kind.removeprefix("streamed ")][prompt_index]
        assert (text, finish_reason) == (reference, "length"), (kind, PROMPTS[prompt_index])
    assert leaving == [CHUNKS_BEFORE_LEAVING] * NUM_LEAVING
    for (path, body, status, param), (got_status, error) in zip(cycle(INVALID), invalid):
        assert got_status == status, (path, body, error)
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        assert error["message"], error

    def added(sample: str) -> float:
        return after[sample] - before[sample]

    num_valid = NUM_VALID_PER_KIND * len(KINDS)
    # Invalid requests never reach the engine; every other one ends as it should.
    assert added("atom:requests_total") == num_valid + NUM_LEAVING
    assert sum(map(added, SUCCEEDED)) == num_valid
    assert added(ABORTED) == NUM_LEAVING
    assert added("atom:e2e_request_latency_seconds_count") == num_valid
    # The leaving clients read tokens, so their requests had a first token.
    assert added("atom:time_to_first_token_seconds_count") == num_valid + NUM_LEAVING
    assert after["atom:kv_cache_free_blocks"] == after["atom:kv_cache_blocks"]

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0, timeout=30)
    last = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert last.choices[0].text == expected["completion"][0]
    assert scrape_metrics(server)["atom:num_requests_running"] == 0


async def drive(server: str) -> tuple[list, list, list]:
    """Sends the 200 requests at once, in a shuffled order; returns the valid ones' (kind,
    prompt index, text, finish reason), the chunks each leaving client read, and each
    invalid one's (status, error)."""
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="-", max_retries=0, timeout=60)
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        valid = [
            valid_request(client, kind, i % len(PROMPTS))
            for kind in KINDS
            for i in range(NUM_VALID_PER_KIND)
        ]
        leaving = [
            leaving_stream(client, PROMPTS[i % len(PROMPTS)], chat=i % 2 == 1)
            for i in range(NUM_LEAVING)
        ]
        invalid = [invalid_request(http, *case) for case in cycle(INVALID)]
        requests = [*valid, *leaving, *invalid]
        order = list(range(len(requests)))
        random.Random(0).shuffle(order)
        # Tasks start in the order they are made.
        tasks = {i: asyncio.ensure_future(requests[i]) for i in order}
        await asyncio.gather(*tasks.values())
    await client.close()
    results = [tasks[i].result() for i in range(len(requests))]
    return results[: len(valid)], results[len(valid) : -len(invalid)], results[-len(invalid) :]


def cycle(cases: list) -> list:
    """NUM_INVALID cases, going round `cases`."""
    return [cases[i % len(cases)] for i in range(NUM_INVALID)]


async def valid_request(client: openai.AsyncOpenAI, kind: str, prompt_index: int):
    """One greedy request of `kind`: (kind, prompt index, text, finish reason)."""
    chat, streamed = kind.endswith("chat"), kind.startswith("streamed")
    response = await create(
        client, PROMPTS[prompt_index], chat, max_tokens=MAX_TOKENS, temperature=0, stream=streamed
    )
    choices = (
        [c async for chunk in response for c in chunk.choices] if streamed else response.choices
    )
    if chat:
        text = "".join((c.delta if streamed else c.message).content or "" for c in choices)
    else:
        text = "".join(c.text for c in choices)
    return kind, prompt_index, text, choices[-1].finish_reason


async def leaving_stream(client: openai.AsyncOpenAI, prompt: str, chat: bool) -> int:
    """Reads a few chunks of a long stream, then closes the connection; the chunks read."""
    chunks = await create(client, prompt, chat, max_tokens=LEAVING_MAX_TOKENS, stream=True)
    read = 0
    async for _ in chunks:
        read += 1
        if read == CHUNKS_BEFORE_LEAVING:
            break
    await chunks.close()
    return read


async def create(client: openai.AsyncOpenAI, prompt: str, chat: bool, **kwargs):
    """A chat completion of `prompt` as the user's message, or a completion of it."""
    kwargs |= {"model": MODEL, "extra_body": {"ignore_eos": True}}
    if chat:
        return await client.chat.completions.create(messages=messages(prompt), **kwargs)
    return await client.completions.create(prompt=prompt, **kwargs)


async def invalid_request(http: httpx.AsyncClient, path: str, body: dict, *_) -> tuple[int, dict]:
    response = await http.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    return response.status_code, response.json()["error"]
