"""DeepSeek-V4's KV compressor: every `rate` tokens become one compressed KV entry.

Each token projects a value `kv` and a gate `gate`; when a window of `rate` tokens closes
(at the token whose position is w * rate + rate - 1), entry w is the softmax-over-the-window
(gate + position_bias) weighted sum of its tokens' kv, RMS-normalised, then rotated at
position w * rate with the "compress" rope.

With `overlap` (CSA layers and their indexer) the projections are twice as wide: the
first half (Ca) of a token feeds the *next* window's entry, the second half (Cb) its own,
so entry w mixes window w - 1's Ca with window w's Cb over 2 * rate slots (entry 0 has no
previous window: those slots weigh nothing). HCA layers compress without overlap.

The layer's impl keeps every token's projections (`project`: kv | gate in one row) in its
pages and calls `compress` with the rows of the windows a step closes: a window may start
in an earlier step (chunked prefill, decode, a prefix-cache hit), so what is "open" is
read back from the cache instead of being carried as per-sequence state.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.layers.linear import ReplicatedLinear
from atom.layers.norm import RMSNorm
from atom.layers.rotary import TrailingRotaryEmbedding


def projection_width(head_dim: int, overlap: bool) -> int:
    """Channels of a token's kv (and of its gate): Ca | Cb with overlap, else head_dim."""
    return (2 if overlap else 1) * head_dim


class KVCompressor(nn.Module):
    """Weights under the checkpoint's names: wkv, wgate [c * head_dim, hidden], ape
    (the position bias) [rate, c * head_dim] fp32, norm [head_dim]; c = 2 with overlap."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        rate: int,
        overlap: bool,
        rotary: TrailingRotaryEmbedding,
        norm_eps: float,
        prefix: str = "",
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rate = rate
        self.overlap = overlap
        width = projection_width(head_dim, overlap)
        # Unquantized in the released checkpoints (BF16 beside FP8 layers).
        self.wkv = ReplicatedLinear(hidden_size, width, prefix=f"{prefix}.wkv")
        self.wgate = ReplicatedLinear(hidden_size, width, prefix=f"{prefix}.wgate")
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, norm_eps)
        self.rotary = rotary  # shared with the layer (not a checkpoint tensor)

    @property
    def row_width(self) -> int:
        """Channels a token keeps in the impl's cache: kv then gate."""
        return 2 * self.ape.shape[1]

    @property
    def span(self) -> int:
        """Tokens an entry reads: its window, and with overlap the one before."""
        return 2 * self.rate if self.overlap else self.rate

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> each token's cache row [T, row_width] (kv | gate)."""
        return torch.cat([self.wkv(hidden_states), self.wgate(hidden_states)], dim=-1)

    def compress(self, rows: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """rows [n, span, row_width]: each entry's tokens in order (with overlap the previous
        window first; entry 0's are ignored); entries [n] the entry indices -> [n, head_dim]
        rotated."""
        return self.finish(self.pool(rows, entries), entries)

    def finish(self, pooled: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """The gated sums of entries [n] -> the entries as cached: normalised, rotated at
        their first token's position."""
        return self.rotary(entries * self.rate, self.norm(pooled))

    def pool(self, rows: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """compress's gated sum over each entry's tokens, before norm and rope (a batched
        kernel computes this part, atom.kernels.triton.window_compression)."""
        d, m = self.head_dim, self.rate
        kv, gate = rows.chunk(2, dim=-1)
        gate = gate.float()
        if self.overlap:
            bias = self.ape.float()
            # Entry 0 has no previous window: its slots get no weight (-inf gate) and no
            # value (the rows read for them are not this sequence's).
            first = (entries == 0)[:, None, None]
            previous_gate = (gate[:, :m, :d] + bias[:, :d]).masked_fill(first, float("-inf"))
            previous_kv = kv[:, :m, :d].masked_fill(first, 0.0)
            kv = torch.cat([previous_kv, kv[:, m:, d:]], dim=1)
            gate = torch.cat([previous_gate, gate[:, m:, d:] + bias[:, d:]], dim=1)
        else:
            gate = gate + self.ape.float()
        weights = gate.softmax(dim=1).to(kv.dtype)
        return (kv * weights).sum(dim=1)
