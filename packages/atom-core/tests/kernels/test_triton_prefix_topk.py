"""The prefix top-k against atom.kernels.indexer.best_positions: the same positions for
rows of every length against k, with ties (the zeros relu leaves, -0.0 beside 0.0,
repeated values) and NaN past each row's length, which the kernel must never read.

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1; skipped otherwise)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from atom.kernels.indexer import best_positions  # noqa: E402
from atom.kernels.triton.prefix_topk import prefix_topk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)


def reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> list[list[int]]:
    rows = []
    for row, length in zip(scores, lengths.tolist()):
        chosen = best_positions(row[None, :length], min(k, length))[0] if length else row[:0]
        rows.append(sorted(chosen.tolist()) + [-1] * (k - len(chosen)))
    return rows


def tied_scores(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """Scores as the indexer makes them: many exact zeros, a few repeats and -0.0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.relu(torch.randn(num_rows, width, generator=g))
    scores[:, ::7] = 0.5  # repeated value
    scores[:, 3::11] = -0.0
    scores[:, 5::13] = -torch.rand(num_rows, len(range(5, width, 13)), generator=g)
    return scores


@pytest.mark.parametrize(
    ("width", "k", "lengths"),
    [
        (40, 8, [0, 1, 7, 8, 9, 40]),  # empty, fewer than k, exactly k, more
        (300, 64, [300, 64, 65, 200]),
        (2500, 100, [2500, 1025, 1024, 3]),  # several blocks of 1024
        (1500, 1200, [1500, 1199, 1201]),  # k beyond one block
    ],
)
def test_prefix_topk_matches_best_positions(width, k, lengths):
    scores = tied_scores(len(lengths), width, seed=width)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    expected = reference(scores, lengths, k)
    for row, length in enumerate(lengths.tolist()):
        scores[row, length:] = float("nan")  # never read
    out = prefix_topk(scores.to(DEVICE), lengths.to(DEVICE), k)
    got = [sorted(p for p in row if p >= 0) for row in out.cpu().tolist()]
    got = [row + [-1] * (k - len(row)) for row in got]
    assert got == expected
    # in position order, -1 only at the end
    for row, length in zip(out.cpu().tolist(), lengths.tolist()):
        chosen = row[: min(k, length)]
        assert chosen == sorted(chosen) and all(p == -1 for p in row[min(k, length) :])


def test_prefix_topk_of_distinct_scores_is_torch_topk():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 5000, generator=g)
    lengths = torch.tensor([5000, 4321, 2049], dtype=torch.int32)
    out = prefix_topk(scores.to(DEVICE), lengths.to(DEVICE), 2048).cpu()
    for row, length in enumerate(lengths.tolist()):
        expected = scores[row, :length].topk(2048).indices.sort().values
        assert torch.equal(out[row].long(), expected)
