"""What `atom serve` lets its operator set beyond the engine: limits, auth, CORS, templates."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_N = 128
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_STOP_STRINGS = 64
# Characters over all of a request's stop strings: the matcher's trie has one node per
# character (64 strings of 100,000 took 15 s and 1.2 GB to build).
DEFAULT_MAX_STOP_CHARS = 16384
# A stalled streaming client costs at most this many unread output tokens (a few MB even
# with 20 top logprobs each) before its call is aborted.
DEFAULT_MAX_UNREAD_TOKENS = 16384


@dataclass(frozen=True)
class ServeOptions:
    """served_model_name: the name clients use. max_n: the most choices one request may ask
            for (n, best_of, and prompts x n of a batch). max_stop_strings: the most stop strings one
            request may give, max_stop_chars their most characters in all. max_unread_tokens: the most output tokens (over its choices) a
        streaming call's client may leave unread before the call is aborted. chat_template: a Jinja template (its text
            or a file path) replacing the tokenizer's. api_key: when set, /v1 routes need
            `Authorization: Bearer <api_key>`. allowed_origins etc.: CORS, as vLLM's options. generation_config: where request sampling
    defaults come from ("auto": the model's generation_config.json, "vllm": none, or a
    folder). tool_call_parser: how tool calls are read from the output (a name of
    atom.server.tool_calls.TOOL_CALL_PARSERS);
    enable_auto_tool_choice: accepted as vLLM's flag (ATOM reads calls with or without it)."""

    served_model_name: str = "model"
    max_n: int = DEFAULT_MAX_N
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS
    chat_template: str | None = None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    generation_config: str = "auto"
    tool_call_parser: str = "hermes"
    enable_auto_tool_choice: bool = False
