"""The state host ATOM's Gated DeltaNet layers get inside vLLM: a vLLM mamba layer.

The wrapper builds hybrid models inside `atom.layers.gated_delta_net.state_backend(
factory)`; every ATOM `GatedDeltaNet` then owns a `VllmStateLayer`, a vLLM `MambaBase`
layer registered under the ATOM layer's name (`model.layers.N.linear_attn`). vLLM's
hybrid KV-cache manager therefore sees an ordinary mamba layer:

* its `MambaSpec` declares ATOM's state layout (`GatedDeltaNet.state_shapes`: conv
  `[C, K-1]` in the model dtype, recurrent `[Hv, Dk, Dv]` in `mamba_ssm_cache_dtype`'s
  dtype, `atom_vllm.model.ssm_state_dtype`), so vLLM sizes one block
  per request for it and binds `[num_blocks, ...]` views of each state (`bind_kv_cache`,
  MambaBase's: the states of a block side by side in one page; ATOM's ops read strides);
* its backend (`atom_vllm.backend.AtomStateBackend`) builds, per step and KV-cache group,
  ATOM's `AttentionMetadata` with each request's block as its `state_slots` row, which
  the model wrapper puts into the step's one metadata (`atom_vllm.step`; the ATOM layer
  reads its group's rows from ATOM's forward context);
* `state_pools()` gives the ATOM layer the two state views.

vLLM's block 0 is its null block, never handed to a request, like the native engine's
scratch row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from atom.layers.gated_delta_net import GatedDeltaNet
from atom_vllm.backend import AtomStateBackend
from atom_vllm.patches import register_layer


class VllmStateLayer(nn.Module, MambaBase):
    """vLLM's state cache of one ATOM Gated DeltaNet layer."""

    def __init__(self, layer: GatedDeltaNet, vllm_config: Any):
        nn.Module.__init__(self)
        self.layer_name = layer.prefix
        shapes = layer.state_shapes()
        self.state_shapes = tuple(shape for shape, _ in shapes)
        self.state_dtypes = tuple(dtype for _, dtype in shapes)
        self.kv_cache = ()  # bound by vLLM (MambaBase.bind_kv_cache)
        self.kv_group = 0  # set by atom_vllm.step
        self.num_calls = 0
        register_layer(vllm_config, self.layer_name, self)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.state_shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state_dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # What the states are (vLLM keys copy functions and KV transfer by it); the
        # backend that builds their metadata is ATOM's, below.
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_attn_backend(self) -> type[AttentionBackend]:
        return AtomStateBackend

    def state_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.num_calls += 1
        conv_state, ssm_state = self.kv_cache
        return conv_state, ssm_state

    def extra_repr(self) -> str:
        return f"layer={self.layer_name!r}, backend=AtomStateBackend"


def vllm_state_factory(vllm_config: Any):
    """The factory `state_backend(...)` takes, for one vLLM model instance."""
    return lambda layer: VllmStateLayer(layer, vllm_config)
