"""Incremental detokenization and stop-string matching for one sequence."""

from __future__ import annotations

from atom.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence, leave_out_last: bool = False) -> str:
        """Re-decodes the output (without its last token with leave_out_last) and returns
        the newly finalised text.

        A trailing U+FFFD means a multi-byte character is still incomplete; it is held
        back until the next token completes it.
        """
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        ids = seq.output_ids[:-1] if leave_out_last else seq.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        if text.endswith("\ufffd") and seq.finish_reason is None:
            text = text.rstrip("\ufffd")
        if not text.startswith(seq.text):
            # Decoding merged across a boundary; keep the already-emitted prefix stable.
            text = seq.text + text[len(seq.text) :]
        delta, seq.text = text[len(seq.text) :], text
        return delta


def find_stop_string(seq: Sequence, new_chars: int) -> str | None:
    """Truncates seq.text at the first stop string that the new text completed."""
    match = seq.params.stop_strings.first_match(seq.text, new_chars)
    if match is None:
        return None
    seq.text = seq.text[: match.start]
    return match.stop
