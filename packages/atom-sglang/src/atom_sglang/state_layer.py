"""The state host ATOM's Gated DeltaNet layers get inside SGLang: a view of its mamba pool.

The wrapper builds hybrid models inside `atom.layers.gated_delta_net.state_backend(
factory)`; every ATOM `GatedDeltaNet` then owns an `SglangStateLayer`. SGLang decides
its pools from the checkpoint's config alone: for Qwen3-Next / Qwen3.5 configs it
allocates a `HybridReqToTokenPool` whose mamba pool holds each linear layer's conv and
recurrent states per request row, sized from the same config fields ATOM's layer reads.
The wrapper binds each to SGLang's request pool (`bind_state_pool`) the first time
ATOM's backend runs a step; per step the ATOM layer reads each request's mamba row
(`state_slots`, which ATOM's metadata builder adds, `atom_sglang.metadata`) from ATOM's
forward context, and its states from `state_pools()`: its layer's states in the pool,
viewed in ATOM's layout (`mamba_pool_states`).

SGLang wraps the "atom" backend of such models in its `HybridLinearAttnBackend` (full
attention layers go to ATOM's backend); SGLang's own linear backend beside it prepares
metadata that ATOM's layers never read.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.configs.mamba_utils import mamba2_state_dtype
from torch import nn

from atom.layers.gated_delta_net import GatedDeltaNet, StateShapes
from atom_sglang.attention_layer import layer_index

logger = logging.getLogger("sglang.atom_sglang.state_layer")


def mamba_pool_states(
    req_to_token_pool: Any, layer_id: int, shapes: StateShapes
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer_id`'s (conv, recurrent) states in SGLang's mamba pool, viewed as
    `[rows, *shape]` of ATOM's `shapes`. SGLang's conv state is ATOM's `[C, K-1]`; its
    recurrent state `[Hv, Dv, Dk]` is only ever written by ATOM's ops here (SGLang zeroes,
    copies and moves whole rows), so its bytes hold ATOM's `[Hv, Dk, Dv]`."""
    cache = req_to_token_pool.mamba2_layer_cache(layer_id)
    pools = (cache.conv[0], cache.temporal)
    for pool, (shape, dtype), what in zip(pools, shapes, ("conv", "recurrent")):
        if pool.dtype != dtype or pool.shape[1:].numel() != torch.Size(shape).numel():
            raise NotImplementedError(
                f"ATOM's Gated DeltaNet (layer {layer_id}) keeps its {what} state as {dtype} "
                f"{list(shape)}; SGLang's mamba pool holds {pool.dtype} "
                f"{list(pool.shape[1:])} (conv dtype: SGLANG_MAMBA_CONV_DTYPE, the model "
                "dtype; recurrent: SGLANG_MAMBA_SSM_DTYPE / mamba_ssm_dtype, which ATOM follows)"
            )
    return tuple(pool.view(pool.shape[0], *shape) for pool, (shape, _) in zip(pools, shapes))


class SglangStateLayer(nn.Module):
    """SGLang's mamba-pool states of one ATOM Gated DeltaNet layer."""

    def __init__(self, layer: GatedDeltaNet):
        super().__init__()
        self.layer_name = layer.prefix
        self.layer_id = layer_index(f"{layer.prefix}.")
        self.state_shapes = layer.state_shapes()
        self.req_to_token_pool: Any = None
        self.kv_group = 0  # SGLang's one mamba pool: the step's own state rows
        self.num_calls = 0

    def bind_state_pool(self, req_to_token_pool: Any) -> None:
        if not hasattr(req_to_token_pool, "get_mamba_indices"):
            raise NotImplementedError(
                f"ATOM's {self.layer_name} keeps per-request states, but SGLang allocated "
                f"no mamba pool ({type(req_to_token_pool).__name__}) for this model"
            )
        self.req_to_token_pool = req_to_token_pool

    def state_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.req_to_token_pool is None:
            raise RuntimeError(f"{self.layer_name}: not bound to SGLang's mamba pool yet")
        self.num_calls += 1
        conv_state, ssm_state = mamba_pool_states(
            self.req_to_token_pool, self.layer_id, self.state_shapes
        )
        if self.num_calls == 1:
            logger.info(
                "ATOM Gated DeltaNet %s: states in SGLang's mamba pool, conv %s, recurrent %s",
                self.layer_name,
                list(conv_state.shape),
                list(ssm_state.shape),
            )
        return conv_state, ssm_state

    def extra_repr(self) -> str:
        return f"layer={self.layer_name!r}, layer_id={self.layer_id}"


def ssm_state_dtype(config: Any) -> torch.dtype:
    """The recurrent state's dtype SGLang allocates its mamba pool in (`SGLANG_MAMBA_SSM_DTYPE`,
    else the config's `mamba_ssm_dtype`, else float32), which ATOM's layers then keep."""
    return mamba2_state_dtype(config).temporal


def sglang_state_factory(layer: GatedDeltaNet) -> SglangStateLayer:
    """The factory `state_backend(...)` takes."""
    return SglangStateLayer(layer)
