"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Per token: input projections give q, k (linear_num_key_heads heads), v and the output
gate z (linear_num_value_heads heads), and per value head b and a; q/k/v pass a short
causal conv1d (SiLU) over their channels; beta = sigmoid(b), g = -exp(A_log) *
softplus(a + dt_bias); the gated delta rule (atom.kernels.gated_delta) mixes them into a
recurrent state; the output is RMSNorm(o) * silu(z) per value head, then out_proj.

The conv and recurrent states live in per-request pools; each step's `AttentionMetadata`
says which pool row (`state_slots`) each sequence uses and whether it holds a state yet.
Every host sets the step's metadata in ATOM's forward context. The native engine binds
the pools once (`bind_state_cache`, atom.engine.state_cache). A host with its own state
manager (vLLM's mamba cache, SGLang's mamba pool) builds the model inside
`state_backend(factory)`: each layer then owns the factory's module (`state_host`), which
hands it its pools in the host's memory (`state_pools()`) and names its KV-cache group
(`kv_group`: whose state rows it reads, `AttentionMetadata.for_kv_group`).
Subclasses supply the input projections (their checkpoint layouts differ): `project(x)`
returns this rank's conv input [T, q | k | v of all heads], z [T, Hv, Dv], b and a
[T, Hv]. Tensor parallelism splits the key heads (with their value heads) over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from atom.config import ConfigError
from atom.distributed import divide, get_tp_group
from atom.forward_context import AttentionMetadata, get_forward_context
from atom.kernels.causal_conv1d import CAUSAL_CONV1D_OP, causal_conv1d
from atom.kernels.gated_delta import GATED_DELTA_RULE_OP, gated_delta_rule
from atom.kernels.gated_delta_gates import gated_delta_gates
from atom.kernels.policy import is_capturable
from atom.layers.linear import RowParallelLinear, copy_shard, copy_weight
from atom.layers.norm import GatedRMSNorm
from atom.layers.quantization import set_weight_attrs

StateShapes = list[tuple[tuple[int, ...], torch.dtype]]


def gated_delta_state_shapes(
    conv_dim: int, conv_width: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
    conv_dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32,
) -> StateShapes:  # fmt: skip
    """One slot's (shape, dtype) of each state, in the layout ATOM's ops take: the conv's
    last K-1 inputs [C, K-1] in the model dtype, and the recurrent state [Hv, Dk, Dv] in
    `ssm_dtype` (the ops do their math in fp32 whatever the state is stored in)."""
    return [
        ((conv_dim, conv_width - 1), conv_dtype),
        ((num_v_heads, head_k_dim, head_v_dim), ssm_dtype),
    ]


def config_state_shapes(
    config: Any, tp_size: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32
) -> StateShapes:
    """`gated_delta_state_shapes` of one tensor-parallel rank, from the HF config alone (for
    hosts that size their state caches before the model exists)."""
    key_dim = divide(config.linear_num_key_heads, tp_size, "linear_num_key_heads")
    key_dim *= config.linear_key_head_dim
    num_v_heads = divide(config.linear_num_value_heads, tp_size, "linear_num_value_heads")
    return gated_delta_state_shapes(
        2 * key_dim + num_v_heads * config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        num_v_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        conv_dtype,
        ssm_dtype,
    )


StepState = tuple[AttentionMetadata, torch.Tensor, torch.Tensor]
StateHostFactory = Callable[["GatedDeltaNet"], nn.Module]
_state_host_factory: StateHostFactory | None = None
_ssm_dtype = torch.float32


@contextmanager
def state_backend(
    factory: StateHostFactory | None, ssm_dtype: torch.dtype = torch.float32
) -> Iterator[None]:
    """Layers built inside get `factory(layer)` as their `state_host` (None: the native
    engine binds their pools itself) and keep their recurrent state in `ssm_dtype`
    (`mamba_ssm_cache_dtype`, vLLM's flag: the model dtype by default, half the bytes of
    fp32 that a decode step moves under a bf16 model)."""
    global _state_host_factory, _ssm_dtype
    previous = _state_host_factory, _ssm_dtype
    _state_host_factory, _ssm_dtype = factory, ssm_dtype
    try:
        yield
    finally:
        _state_host_factory, _ssm_dtype = previous


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_tp_group()
        self.prefix = prefix
        total_k_heads, total_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if total_v_heads % total_k_heads:
            raise ConfigError(
                f"linear_num_value_heads={total_v_heads} is not a multiple of "
                f"linear_num_key_heads={total_k_heads}"
            )
        self.num_k_heads = divide(total_k_heads, tp.world_size, "linear_num_key_heads")
        self.num_v_heads = divide(total_v_heads, tp.world_size, "linear_num_value_heads")
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        self.activation = config.hidden_act
        self.build_projections(config, quant_config, prefix)
        self.conv1d = nn.Module()  # the checkpoint's `conv1d.weight` [C, 1, K], no bias
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, self.conv_width), requires_grad=False
        )
        set_weight_attrs(self.conv1d.weight, weight_loader=self._load_conv_weight)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log):
            set_weight_attrs(param, weight_loader=partial(copy_shard, index=tp.rank))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(
            total_v_heads * self.head_v_dim,
            config.hidden_size,
            quant_config=quant_config,
            prefix=f"{prefix}.out_proj",
        )
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.ssm_dtype = _ssm_dtype
        # Last: the factory reads the layer's prefix and state shapes.
        self.state_host = _state_host_factory(self) if _state_host_factory else None

    def build_projections(self, config: Any, quant_config, prefix: str) -> None:
        raise NotImplementedError

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed [T, conv_dim], z [T, Hv, Dv], b, a): b and a [T, Hv], or [T, Hk, Hv / Hk]
        grouped by key head (atom.kernels.gated_delta_gates)."""
        raise NotImplementedError

    def _load_conv_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # Channels are [q | k | v] of all heads; this rank keeps its heads of each.
        tp = get_tp_group()
        local = (self.key_dim, self.key_dim, self.value_dim)
        parts = loaded.split([size * tp.world_size for size in local])
        copy_weight(
            param,
            torch.cat([part.narrow(0, tp.rank * size, size) for part, size in zip(parts, local)]),
        )

    def state_shapes(self) -> StateShapes:
        return gated_delta_state_shapes(
            self.conv_dim,
            self.conv_width,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.conv1d.weight.dtype,
            self.ssm_dtype,
        )

    def bind_state_cache(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def cuda_graph_safe_for(self, query_tokens: int) -> bool:
        """Whether both ops can be captured on this device in steps of `query_tokens`
        tokens per sequence (a decode, or a speculative verify step)."""
        device = self.A_log.device
        return device.type == "cuda" and all(
            is_capturable(op, device, query_tokens)
            for op in (GATED_DELTA_RULE_OP, CAUSAL_CONV1D_OP)
        )

    def step_state(self) -> StepState | None:
        """This step's metadata (as this layer's KV-cache group sees it) and its (conv,
        recurrent) pools; None: a host's profiling run (no metadata and no states yet)."""
        metadata = get_forward_context().attn_metadata
        host = self.state_host
        if host is None:
            return metadata, self.conv_state, self.ssm_state
        if metadata is None:
            return None
        conv_state, ssm_state = host.state_pools()
        return metadata.for_kv_group(host.kv_group), conv_state, ssm_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.step_state()
        if step is None:  # no states and no metadata exist yet: only the output shape counts
            return self.out_proj(x.new_zeros(x.shape[0], self.value_dim))
        metadata, conv_state, ssm_state = step
        if metadata is None or metadata.state_slots is None or ssm_state is None:
            raise RuntimeError(
                f"{self.prefix}: Gated DeltaNet needs its state pools and step metadata with "
                "state_slots (run the model under atom.forward_context.set_forward_context)"
            )
        slots, starts, has_state = (
            metadata.state_slots,
            metadata.query_start_loc,
            metadata.has_initial_state,
        )
        mixed, z, b, a = self.project(x)
        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        if metadata.state_checkpoints is not None:
            metadata.state_checkpoints.keep(self, conv_state, ssm_state, mixed, g, beta)
        out = self._mix(
            mixed, g, beta, conv_state, ssm_state, slots, starts, has_state, metadata.max_query_len
        )
        out = self.norm(out, z)
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))

    def _mix(
        self, mixed, g, beta, conv_state, ssm_state, slots, starts, has_state, max_query_len=None
    ):
        """The conv over the rows' inputs `mixed` [T, C], then the gated delta rule: the
        output [T, Hv, Dv]; both update the states in rows `slots`. max_query_len: the
        step's bound on any sequence's rows (None: unknown)."""
        num_tokens = mixed.shape[0]
        mixed = causal_conv1d(
            mixed,
            self.conv1d.weight.view(self.conv_dim, self.conv_width),
            None,
            conv_state,
            slots,
            starts,
            has_state,
            self.activation,
        )
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return gated_delta_rule(
            q.view(num_tokens, self.num_k_heads, self.head_k_dim),
            k.view(num_tokens, self.num_k_heads, self.head_k_dim),
            v.view(num_tokens, self.num_v_heads, self.head_v_dim),
            g,
            beta,
            ssm_state,
            slots,
            starts,
            has_state,
            scale=self.head_k_dim**-0.5,
            use_qk_l2norm=True,
            max_query_len=max_query_len,
        )

    def remix(self, slots, conv, recurrent, mixed, g, beta, starts) -> None:
        """Speculative rollback (atom.speculative.state_rollback): puts states saved before
        a step back into rows `slots`, then mixes the kept rows' inputs into them again."""
        self.conv_state[slots] = conv
        self.ssm_state[slots] = recurrent
        has_state = torch.ones(len(slots), dtype=torch.bool, device=slots.device)
        self._mix(mixed, g, beta, self.conv_state, self.ssm_state, slots.int(), starts, has_state)
