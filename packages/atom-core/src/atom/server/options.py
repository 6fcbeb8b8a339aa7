"""What `atom serve` lets its operator set beyond the engine: limits, auth, CORS, templates."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_N = 128
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_STOP_STRINGS = 64


@dataclass(frozen=True)
class ServeOptions:
    """served_model_name: the name clients use. max_n: the most choices one request may ask
    for (n, best_of, and prompts x n of a batch). max_stop_strings: the most stop strings one
    request may give. chat_template: a Jinja template (its text
    or a file path) replacing the tokenizer's. api_key: when set, /v1 routes need
    `Authorization: Bearer <api_key>`. allowed_origins etc.: CORS, as vLLM's options."""

    served_model_name: str = "model"
    max_n: int = DEFAULT_MAX_N
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    chat_template: str | None = None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
