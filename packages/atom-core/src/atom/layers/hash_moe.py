"""DeepSeek-V4's MoE block: a router that picks experts by score or by token id, the
fused experts with clamped SwiGLU, and one shared expert (clamped the same way).

"hash_moe" layers take their experts from a table in the checkpoint, `tid2eid[token id]`,
so the forward needs the step's token ids; the learned scores still weigh the chosen
experts. "moe" layers take the top-k of the scores plus a selection-only correction
bias. Either way the weights are the chosen scores renormalised, times
routed_scaling_factor, and the scores are `scoring_func` of the router logits (fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom.kernels.activation import clamped_silu
from atom.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from atom.layers.moe import FusedMoE

SCORING_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
}


class HashOrScoreRouter(nn.Module):
    """Weights under the checkpoint's names: `weight` [E, hidden], and `tid2eid` [vocab, k]
    (hash layers) or `bias` [E] (the correction bias of the others)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, vocab_size: int, hashed: bool,
        scoring_func: str, routed_scaling_factor: float,
    ):  # fmt: skip
        super().__init__()
        self.top_k = top_k
        self.score = SCORING_FUNCS[scoring_func]
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.tid2eid = self.bias = None
        if hashed:
            self.tid2eid = nn.Parameter(
                torch.zeros(vocab_size, top_k, dtype=torch.long), requires_grad=False
            )
        else:
            self.bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] int32)."""
        scores = self.score(F.linear(hidden_states.float(), self.weight.float()))
        if self.tid2eid is not None:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids.to(torch.int32)


class ClampedMLP(nn.Module):
    """The shared expert: w1 (gate) and w3 (up) stacked as gate_up_proj, w2 as down_proj."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, limit: float, quant_config, prefix: str
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = clamped_silu(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class HashMoE(nn.Module):
    """hidden [T, hidden] and the tokens' ids [T] -> [T, hidden]."""

    def __init__(self, config, hashed: bool, quant_config=None, prefix: str = ""):
        super().__init__()
        limit = config.swiglu_limit
        self.gate = HashOrScoreRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
            config.vocab_size, hashed, config.scoring_func, config.routed_scaling_factor,
        )  # fmt: skip
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            activation=clamped_silu(limit),
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.shared_experts = ClampedMLP(
            config.hidden_size,
            config.moe_intermediate_size * config.n_shared_experts,
            limit,
            quant_config,
            f"{prefix}.shared_experts",
        )

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden_states, input_ids)
        routed = self.experts.apply_experts(hidden_states, weights, ids)
        return routed + self.shared_experts(hidden_states)
