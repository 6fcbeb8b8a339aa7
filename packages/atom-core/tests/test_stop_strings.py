"""Stop strings are found as the text grows, each step looking at the new text only: the
earliest match to end wins (of those ending together, the longest), matches that span
earlier text are found, and a step's cost does not grow with the number of stop strings."""

from __future__ import annotations

import random
import time

import pytest

from atom.stop_strings import StopMatch, StopStrings


def naive_first_match(stops: list[str], text: str, new_chars: int) -> StopMatch | None:
    """Every stop string at every place a match could end, earliest end first."""
    for end in range(len(text) - new_chars + 1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            longest = max(ending, key=len)
            return StopMatch(end - len(longest), longest)
    return None


@pytest.mark.parametrize(
    ("stops", "text", "new_chars", "expected"),
    [
        (["ab", "b"], "zzab", 1, StopMatch(2, "ab")),  # the longest of those ending together
        (["cd", "b"], "abcd", 3, StopMatch(1, "b")),  # the earliest to end, not the first given
        (["xyz"], "xyz", 1, StopMatch(0, "xyz")),  # spanning text of earlier steps
        (["xyz"], "xyzq", 1, None),  # ended before the new text: found by an earlier step
        (["a", "a"], "ba", 1, StopMatch(1, "a")),
        ([], "abc", 3, None),
    ],
)
def test_first_match(stops, text, new_chars, expected):
    assert StopStrings(stops).first_match(text, new_chars) == expected


def test_agrees_with_a_naive_search_on_random_text():
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choices("abc ", k=rng.randint(1, 20)))
        new_chars = rng.randint(0, len(text))
        assert StopStrings(stops).first_match(text, new_chars) == naive_first_match(
            stops, text, new_chars
        ), (stops, text, new_chars)


def test_a_step_costs_the_same_with_100000_stop_strings():
    """Scanning every stop string at every step (as before) takes minutes here."""
    rng = random.Random(1)
    stops = ["".join(rng.choices("abcdefgh ", k=12)) for _ in range(100_000)]
    matcher, text = StopStrings(stops), ""
    start = time.perf_counter()
    for _ in range(2000):
        text += " word"
        assert matcher.first_match(text, len(" word")) is None
    assert time.perf_counter() - start < 2.0
