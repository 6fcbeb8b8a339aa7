"""The fused MoE layer: routing + experts, experts sharded in the weight loader.

Expert weights are stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I],
with optional biases w13_bias [E, 2I] and w2_bias [E, H] (GPT-OSS). Under tensor
parallelism each rank holds a slice of every expert's intermediate dimension, so the
outputs are summed with one all-reduce, as in a row-parallel linear; rank 0 alone holds
w2_bias, so it is added once. Under expert parallelism (atom.expert_parallel) each rank
holds E/N whole experts, with their biases, and the loader skips the other ranks' experts.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.distributed import divide, get_tp_group
from atom.expert_parallel import get_expert_parallel
from atom.kernels import grouped_topk, topk_softmax
from atom.kernels.moe import MoEActivation, check_moe_activation
from atom.kernels.policy import is_capturable
from atom.layers.quantization import QuantizationConfig, set_weight_attrs
from atom.layers.quantization.unquantized import UnquantizedMoEMethod

# Checkpoint shard names: w1 = gate, w3 = up (both in w13), w2 = down.
_W13_HALF = {"w1": 0, "w3": 1}


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool = True,
        use_grouped_topk: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        scoring_func: str = "softmax",
        e_score_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        reduce_results: bool = True,
        activation: MoEActivation = "silu",
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        check_moe_activation(activation)
        self.tp = get_tp_group()
        self.ep = get_expert_parallel()
        self.prefix = prefix
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.reduce_results = reduce_results
        self.activation = activation
        if self.ep is None:
            self.placement = None
            self.shard_rank, shard_size = self.tp.rank, self.tp.world_size
        else:
            if not reduce_results:
                raise ValueError(f"{prefix}: expert parallelism combines the outputs itself")
            self.placement = self.ep.placement(num_experts, f"{prefix} num_experts")
            self.shard_rank, shard_size = 0, 1
        num_local_experts = num_experts if self.placement is None else self.placement.count
        self.intermediate_per_rank = divide(
            intermediate_size, shard_size, f"{prefix} moe_intermediate_size"
        )
        if e_score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        self.quant_method = (
            quant_config.moe_method(prefix) if quant_config else UnquantizedMoEMethod()
        )
        self.quant_method.create_weights(
            self, num_local_experts, hidden_size, self.intermediate_per_rank,
            torch.get_default_dtype(),
        )  # fmt: skip
        self.w13_bias = self.w2_bias = None
        if bias:
            if not getattr(self.quant_method, "supports_bias", False):
                raise ValueError(
                    f"{prefix}: expert biases are not supported by "
                    f"{type(self.quant_method).__name__}"
                )
            dtype = torch.get_default_dtype()
            self.w13_bias = nn.Parameter(
                torch.zeros(num_local_experts, 2 * self.intermediate_per_rank, dtype=dtype),
                requires_grad=False,
            )
            self.w2_bias = nn.Parameter(
                torch.zeros(num_local_experts, hidden_size, dtype=dtype), requires_grad=False
            )
            for param in (self.w13_bias, self.w2_bias):
                set_weight_attrs(param, weight_loader=self.weight_loader)

    @staticmethod
    def make_expert_params_mapping(
        ckpt_gate_proj_name: str, ckpt_down_proj_name: str, ckpt_up_proj_name: str, num_experts: int
    ) -> list[tuple[str, str, int, str]]:
        """(param fragment, checkpoint fragment, expert id, shard id) for `load_with_mapping`.

        Fragments end with "." so that expert 1 does not match expert 11.
        """
        mapping = []
        for expert in range(num_experts):
            for shard, name in (
                ("w1", ckpt_gate_proj_name),
                ("w2", ckpt_down_proj_name),
                ("w3", ckpt_up_proj_name),
            ):
                param = "experts.w13_" if shard in _W13_HALF else "experts.w2_"
                mapping.append((param, f"experts.{expert}.{name}.", expert, shard))
        return mapping

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
    ) -> None:
        """Copies one expert's gate, up or down tensor (or its scale or bias) into the stacked
        param; under expert parallelism, only the experts this rank holds."""
        if self.placement is not None:
            expert_id = self.placement.local_expert(expert_id)
            if expert_id is None:
                return
        target = param.data[expert_id]
        if param is self.w2_bias:  # the all-reduce sums the ranks' outputs
            if self.shard_rank == 0:
                target.copy_(loaded)
            return
        if getattr(param, "per_shard", False):  # one scalar per expert and shard
            target[_W13_HALF.get(shard_id, 0)].copy_(loaded.reshape(()))
            return
        block = getattr(param, "shard_block", 1)
        rows = -(-self.intermediate_per_rank // block)
        if shard_id in _W13_HALF:  # weight rows or bias entries
            source = loaded.narrow(0, self.shard_rank * rows, rows)
            target = target.narrow(0, _W13_HALF[shard_id] * rows, rows)
        else:
            source = loaded.narrow(1, self.shard_rank * rows, rows)
        if source.shape != target.shape:
            # Naming the format the config chose points at the field when a checkpoint's
            # experts are stored otherwise (DeepSeek-V4's FP4 experts read as FP8).
            chosen = getattr(self.quant_method, "checkpoint_format", "")
            raise ValueError(
                f"shape mismatch: expert {expert_id} {shard_id} expects {tuple(target.shape)}, "
                f"checkpoint slice is {tuple(source.shape)}" + (f" ({chosen})" if chosen else "")
            )
        target.copy_(source)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether the routing and expert kernels this layer dispatches to on its device can be
        captured (the torch fused-MoE reference loops over the experts that got tokens)."""
        device = next(self.parameters()).device
        routing = "grouped_topk" if self.use_grouped_topk else "topk_softmax"
        experts = getattr(self.quant_method, "kernel_op", "fused_moe")
        return device.type == "cuda" and all(is_capturable(op, device) for op in (routing, experts))

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_grouped_topk:
            return grouped_topk(
                router_logits,
                self.top_k,
                self.num_expert_group,
                self.topk_group,
                self.renormalize,
                self.scoring_func,
                self.e_score_correction_bias,
                self.routed_scaling_factor,
            )
        weights, ids = topk_softmax(router_logits, self.top_k, self.renormalize)
        if self.routed_scaling_factor != 1.0:  # a launch per layer otherwise
            weights = weights * self.routed_scaling_factor
        return weights, ids

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.apply_experts(hidden_states, *self.route(router_logits))

    def apply_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts for routing the model decided itself (DeepSeek-V4's hash layers pick
        experts by token id): weights [T, k] and expert ids [T, k]."""
        if self.ep is not None:
            return self._forward_expert_parallel(hidden_states, topk_weights, topk_ids)
        out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out

    def _forward_expert_parallel(self, hidden_states, topk_weights, topk_ids) -> torch.Tensor:
        exchange = self.ep.exchange
        hidden_states, topk_weights, topk_ids = exchange.dispatch(
            hidden_states, topk_weights, topk_ids, self.placement
        )
        local_ids = self.placement.local_ids(topk_ids)
        return exchange.combine(
            self.quant_method.apply(self, hidden_states, topk_weights, local_ids)
        )
