"""Everything a route handler needs, built once per server."""

from __future__ import annotations

from dataclasses import dataclass

from atom.server.async_engine import AsyncEngine
from atom.server.guided import GuidedDecoding
from atom.server.limits import RequestLimits
from atom.server.options import ServeOptions
from atom.server.tokenization import Tokenization


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenization: Tokenization
    limits: RequestLimits
    options: ServeOptions
    guided: GuidedDecoding
    sampling_defaults: dict  # for the sampling fields a request leaves out

    @classmethod
    def of(
        cls,
        engine: AsyncEngine,
        options: ServeOptions,
        chat_template: str | None,
        sampling_defaults: dict | None = None,
    ):
        limits = RequestLimits.of(engine.tokenizer, engine.max_model_len, options)
        guided = GuidedDecoding(
            engine.tokenizer, engine.vocab_size, sorted(engine.engine.eos_token_ids)
        )
        tokenization = Tokenization(engine.tokenizer, chat_template)
        return cls(engine, tokenization, limits, options, guided, sampling_defaults or {})

    @property
    def model(self) -> str:
        return self.options.served_model_name
