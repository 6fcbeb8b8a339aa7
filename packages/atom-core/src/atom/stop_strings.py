"""Finds the stop strings that new output text completes, in time that does not grow with
how many stop strings a request gives.

The stop strings are kept reversed in a trie. A match that the new text completes ends at
one of the new characters; from each such end the trie is walked backwards through the
text, at most as far as the longest stop string, so each step costs
O(new characters x longest stop string) whether there are 3 stop strings or 100,000.
"""

from __future__ import annotations

from dataclasses import dataclass

_STOP = ""  # the key that marks a trie node where a (reversed) stop string ends


@dataclass(frozen=True)
class StopMatch:
    start: int  # where the stop string begins in the text (the text is cut there)
    stop: str


class StopStrings:
    def __init__(self, stops: list[str]):
        self.reversed_trie: dict = {}
        for stop in stops:
            node = self.reversed_trie
            for char in reversed(stop):
                node = node.setdefault(char, {})
            node.setdefault(_STOP, stop)  # a repeated stop string keeps its first spelling

    def first_match(self, text: str, new_chars: int) -> StopMatch | None:
        """The match that ends earliest among those ending in the last `new_chars`
        characters of `text`; of several ending there, the longest (so no stop string
        is left in the text)."""
        for end in range(len(text) - new_chars + 1, len(text) + 1):
            match = self._longest_ending_at(text, end)
            if match is not None:
                return match
        return None

    def _longest_ending_at(self, text: str, end: int) -> StopMatch | None:
        node, longest = self.reversed_trie, None
        for start in range(end - 1, -1, -1):
            node = node.get(text[start])
            if node is None:
                break
            if _STOP in node:
                longest = StopMatch(start, node[_STOP])
        return longest
