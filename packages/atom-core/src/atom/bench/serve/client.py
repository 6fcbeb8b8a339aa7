"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

TTFT runs from sending the request to the first chunk that carries output; ITL is the gap
between successive such chunks (a chunk may hold several tokens when the server batches
its stream). Output tokens come from the final usage (`stream_options.include_usage`),
else from the number of output chunks. A server without a tokenizer may stream no text at
all, only a final chunk with a finish reason: that chunk then stands for the first output.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from atom.bench.serve.options import ENDPOINTS
from atom.bench.serve.workloads import Request, as_text


@dataclass
class RequestResult:
    prompt_len: int  # tokens sent, or the server's count where it reports one
    expected_output_len: int
    ok: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between output chunks
    error: str = ""


def request_body(request: Request, endpoint: str, model: str) -> dict:
    """Greedy, exactly `output_len` tokens: ignore_eos and min_tokens keep a stop token
    from ending it early (vLLM and SGLang accept both as well)."""
    body = dict(
        model=model,
        max_tokens=request.output_len,
        min_tokens=request.output_len,
        ignore_eos=True,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": as_text(request.prompt)}]
    else:
        body["prompt"] = request.prompt
    return body


def chunk_output(chunk: dict) -> tuple[bool, bool]:
    """(has output, finishes) for one streamed chunk of either endpoint: text, chat delta
    content or token ids count as output; a chat delta with only the role does not."""
    choices = chunk.get("choices") or []
    if not choices:
        return False, False
    choice = choices[0]
    content = choice.get("text") or (choice.get("delta") or {}).get("content")
    return bool(content or choice.get("token_ids")), choice.get("finish_reason") is not None


async def send(
    client: httpx.AsyncClient, base_url: str, endpoint: str, model: str, request: Request
) -> RequestResult:
    result = RequestResult(len(request.prompt), request.output_len)
    chunk_times: list[float] = []
    finish_time = None
    usage = None
    start = time.perf_counter()
    try:
        url = base_url + ENDPOINTS[endpoint]
        async with client.stream("POST", url, json=request_body(request, endpoint, model)) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return result
            async for line in r.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                usage = chunk.get("usage") or usage
                has_output, finishes = chunk_output(chunk)
                if has_output:
                    chunk_times.append(now)
                if finishes and finish_time is None:
                    finish_time = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.latency = time.perf_counter() - start
    if not chunk_times and finish_time is not None:
        chunk_times = [finish_time]
    if not chunk_times:
        result.error = "the stream carried no output"
        return result
    result.ttft = chunk_times[0] - start
    result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    result.output_tokens = usage["completion_tokens"] if usage else len(chunk_times)
    result.prompt_len = usage["prompt_tokens"] if usage else result.prompt_len
    result.ok = True
    return result
