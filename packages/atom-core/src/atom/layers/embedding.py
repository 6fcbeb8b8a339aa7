"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.distributed import get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = ""):
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.per_rank, embedding_dim, dtype=torch.get_default_dtype()),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"shape mismatch: expected ({self.num_embeddings}, {param.shape[1]}), "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the last position of each sequence; each rank computes its vocab slice."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, bias: bool = False, prefix: str = ""
    ):
        super().__init__(num_embeddings, embedding_dim, prefix)
        if bias:
            raise ValueError("LM heads with a bias are not supported")

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]
