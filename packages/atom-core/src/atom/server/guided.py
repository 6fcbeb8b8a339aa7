"""Guided decoding through xgrammar: a GuideSpec compiles once into a grammar; each
completion then gets a GrammarGuide, whose matcher gives the allowed-token mask before
every sample and advances with the token sampled.

xgrammar is optional (`pip install "atom-core[guided]"`) and imported on first use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import torch

from atom.server.errors import APIError
from atom.server.guided_protocol import GuideSpec

NO_XGRAMMAR = 'guided decoding needs xgrammar: pip install "atom-core[guided]"'
NO_TOKENIZER = "guided decoding needs the tokenizer; this server runs with --skip-tokenizer-init"
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarGuide:
    """One completion's position in its grammar (a TokenGuide)."""

    def __init__(self, xgrammar, compiled):
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.rejected = False

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = (self.bitmask[0, :, None] >> _BIT_SHIFTS) & 1
        return bits.flatten()[:vocab_size].bool()

    def accept(self, token_id: int) -> None:
        # Only a token the mask forbade is refused (a row whose every allowed token was
        # also blocked, e.g. EOS under min_tokens); the grammar cannot go on after it.
        if not self.matcher.accept_token(token_id):
            self.rejected = True

    @property
    def is_done(self) -> bool:
        return self.rejected or self.matcher.is_terminated()


# xgrammar's C++ errors start "[23:55:17] /project/cpp/regex_converter.cc:83: ": a time and
# a source location that mean nothing to the client.
_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _without_source_location(message: str) -> str:
    first_line = message.strip().partition("\n")[0]
    return _SOURCE_LOCATION.sub("", first_line)


class GuidedDecoding:
    """Compiles guide specs for one server's tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._xgrammar = None
        self._compiler = None

    def guide_factory(self, spec: GuideSpec) -> Callable[[], GrammarGuide]:
        """Compiles `spec` (slow for a big schema: call off the event loop); a 400 naming
        the field when it does not compile."""
        compiler = self._compiler_for(spec)
        try:
            compiled = self._compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _without_source_location(str(exc)) or type(exc).__name__
            raise APIError(
                400, f"{spec.param}: cannot compile: {message}", param=spec.param
            ) from None
        xgrammar = self._xgrammar
        return lambda: GrammarGuide(xgrammar, compiled)

    def _compiler_for(self, spec: GuideSpec):
        if self.tokenizer is None:
            raise APIError(400, NO_TOKENIZER, param=spec.param)
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise APIError(400, NO_XGRAMMAR, param=spec.param) from None
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._xgrammar = xgrammar
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        return self._compiler

    @staticmethod
    def _compile(compiler, spec: GuideSpec):
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "json":
            # No free whitespace: a weak model can otherwise fill its budget with spaces.
            schema = spec.value if isinstance(spec.value, str) else json.dumps(spec.value)
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(spec.value)
