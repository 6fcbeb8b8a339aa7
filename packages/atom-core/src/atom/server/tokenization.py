"""The server's tokenizer work (encode, chat template, decode) on one worker thread.

Off the event loop, so a long prompt never delays another client's stream, and off the
engine thread, so it never delays a step. One thread, because a HF fast tokenizer is not
meant to encode from several threads at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from atom.server.errors import APIError

NO_TOKENIZER = (
    "this server runs without a tokenizer (--skip-tokenizer-init): send prompts as token ids"
)


def load_chat_template(template: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself (as vLLM)."""
    if template is None or any(c in template for c in "{\n"):
        return template
    path = Path(template)
    if not path.is_file():
        raise ValueError(f"--chat-template {template!r} is neither a file nor a template")
    return path.read_text()


class Tokenization:
    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="atom-tokenizer")

    async def offload(self, fn, *args):
        """fn(*args) on the tokenizer thread: for response building that decodes tokens."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def _run(self, fn, *args):
        if self.tokenizer is None:
            raise APIError(400, NO_TOKENIZER)
        return await self.offload(fn, *args)

    async def encode(
        self, prompts: list[str | list[int]], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each prompt; token-id prompts pass through untouched."""
        if all(isinstance(p, list) for p in prompts):
            return [list(p) for p in prompts]
        return await self._run(self._encode_all, prompts, add_special_tokens)

    def _encode_all(self, prompts: list, add_special_tokens: bool) -> list[list[int]]:
        return [
            p
            if isinstance(p, list)
            else self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            for p in prompts
        ]

    async def render_chat(
        self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict[str, Any]
    ) -> list[int]:
        return await self._run(self._render_chat, messages, add_generation_prompt, template_kwargs)

    def _render_chat(self, messages, add_generation_prompt, template_kwargs) -> list[int]:
        # The template writes any special tokens itself, so the tokenizer must not add
        # its own (a second BOS).
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except (TemplateError, ValueError, TypeError) as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)
