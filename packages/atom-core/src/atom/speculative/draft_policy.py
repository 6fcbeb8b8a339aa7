"""Which sequences draft in a step, and how many tokens."""

from __future__ import annotations

import logging

from atom.engine.sampler import uses_penalties
from atom.engine.sequence import Sequence
from atom.speculative.config import SpeculativeConfig

logger = logging.getLogger(__name__)


class DraftPolicy:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int):
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self._logged: set[str] = set()

    def may_draft(self, seq: Sequence) -> bool:
        """Penalties, logit_bias and guides change each token's distribution with the
        tokens before it; such sequences decode one token per step (logged once)."""
        params = seq.params
        feature = (
            "penalties" if uses_penalties(params)
            else "logit_bias or guided decoding" if params.has_logits_processors
            else None
        )  # fmt: skip
        if feature is None:
            return True
        if feature not in self._logged:
            self._logged.add(feature)
            logger.info("speculative decoding: requests with %s decode without drafts", feature)
        return False

    def num_drafts(self, seq: Sequence) -> int:
        """Drafts a decoding sequence verifies this step: none before the drafter has
        read its last rows, while EOS is still blocked (min_tokens), or past its limit."""
        if seq.drafter_backlog is None or not self.may_draft(seq):
            return 0
        params = seq.params
        if seq.num_output_tokens < params.min_tokens:
            return 0
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_tokens)
        return max(0, min(self.num_speculative_tokens, limit - seq.num_tokens - 1))
