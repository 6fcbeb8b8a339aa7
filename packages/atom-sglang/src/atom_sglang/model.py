"""The model class SGLang instantiates for every architecture ATOM serves.

One generic `AtomForCausalLM`; `wrapper_class(arch)` makes the subclass named after the
architecture (SGLang keys its model registry by class name). SGLang constructs it with
`(config=hf_config, quant_config=...)` under its default dtype and device, then:

* config: ATOM's model is built from SGLang's HF config with the checkpoint's true MLP
  sizes (`atom_sglang.config`: SGLang's CPU loader pads them);
* TP: SGLang's tensor-parallel group is installed as ATOM's (`atom.distributed`);
* attention: the ATOM model is built inside `attention_backend(factory)`, so each ATOM
  attention layer owns an SGLang `RadixAttention` (`atom_sglang.attention_layer`), of
  the kind the family's adapter declares (`atom_sglang.adapters`);
* state (hybrid models): built inside `state_backend(factory)` too, so each Gated
  DeltaNet layer reads its states from SGLang's mamba pool (`atom_sglang.state_layer`);
* forward (the bridge): when ATOM's backend runs the step, ATOM's model runs with the
  step's one complete metadata (built by that backend from the `ForwardBatch`,
  `atom_sglang.metadata`) in ATOM's forward context, and its layers are bound to
  SGLang's pools the first time; under SGLang's own backend, with that backend for the
  step (`sglang_backend_attention`: the layers hand it their `RadixAttention`, the
  `ForwardBatch` stays here). The hidden states go
  through SGLang's `LogitsProcessor` with ATOM's LM head (a vocab-parallel slice per
  rank, as SGLang's own), giving `LogitsProcessorOutput`;
* weights: `load_weights` takes SGLang's iterator (the checkpoint is read once). SGLang's
  loader then runs every module's `quant_method.process_weights_after_loading`, which
  are ATOM's own post-load hooks (ATOM's layers keep their quant methods there).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.model_executor.forward_context import get_attn_backend, get_token_to_kv_pool
from torch import nn

from atom.cuda_graphs import graph_blockers
from atom.forward_context import HostAttention, set_forward_context
from atom.hosts.cache_bytes import (
    bytes_per_token_line,
    mla_bytes_per_token,
    packed_bytes_per_token,
)
from atom.hosts.packed_pages import packed_row_width
from atom.hosts.plugin import architecture_subclass
from atom.layers.attention import attention_backend
from atom.layers.gated_delta_net import state_backend
from atom.layers.quantization import get_quant_config
from atom.loader import take_kv_scales
from atom.registry import ModelEntry, get_entry
from atom_sglang.adapters import SglangAdapter, adapter_for
from atom_sglang.attention_layer import (
    LAYER_FOR_ATTENTION,
    SglangAttention,
    SglangCompressedAttention,
    SglangMLAAttention,
    sglang_attention_factory,
)
from atom_sglang.backend import AtomAttnBackend, atom_backend_of
from atom_sglang.config import UnsupportedSglangFeature, atom_model_config
from atom_sglang.distributed import install_sglang_groups
from atom_sglang.patches import (
    capture_decode_batches_up_to,
    decode_graphs_enabled,
    keep_prefill_eager,
)
from atom_sglang.state_layer import SglangStateLayer, sglang_state_factory, ssm_state_dtype

logger = logging.getLogger("sglang.atom_sglang.model")

ATOM_MODEL_ATTR = "atom_model"
# Decode batches up to this size run in CUDA graphs (atom_sglang.patches, change 3).
DECODE_GRAPH_MAX_BS = 1024


def sglang_backend_attention(forward_batch: Any) -> HostAttention:
    """SGLang's own attention backend for one step, as ATOM's layers call it: a
    `RadixAttention` run with the step's batch, which only this bridge holds."""

    def attend(radix_attention: Any, q, k, v, /, **kwargs: Any) -> torch.Tensor:
        return radix_attention(q, k, v, forward_batch, **kwargs)

    return attend


class AtomForCausalLM(nn.Module):
    """SGLang's causal-LM model interface around an ATOM model."""

    atom_architecture: ClassVar[str] = ""

    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "", **kwargs: Any):
        super().__init__()
        self.entry: ModelEntry = get_entry(self.atom_architecture)
        self.adapter: SglangAdapter = adapter_for(self.entry)
        self.config = config
        self.tp_group = install_sglang_groups()
        atom_quant = get_quant_config(config)
        model_cls = self.entry.load_class()
        with (
            attention_backend(sglang_attention_factory(self.adapter)),
            state_backend(sglang_state_factory, ssm_state_dtype(config)),
        ):
            atom_model = model_cls(atom_model_config(config), atom_quant, prefix=prefix)
        setattr(self, ATOM_MODEL_ATTR, atom_model)
        self.logits_processor = LogitsProcessor(config)
        self._pool_checked = False
        self._bound_to: AtomAttnBackend | None = None
        device = next(atom_model.parameters()).device
        if keep_prefill_eager():
            logger.info("ATOM models run prefill without CUDA graphs (atom_sglang.patches)")
        # After the prefill switch: from here on only decode steps can be captured.
        blockers = graph_blockers(atom_model, device) if device.type == "cuda" else []
        if blockers and decode_graphs_enabled():
            raise UnsupportedSglangFeature(
                f"ATOM {self.entry.architecture} on this device cannot be captured in CUDA "
                f"graphs ({', '.join(blockers)}): run SGLang with disable_cuda_graph=True "
                "(--disable-cuda-graph)"
            )
        self.has_state_layers = any(isinstance(m, SglangStateLayer) for m in atom_model.modules())
        if decode_graphs_enabled() and self.has_state_layers:
            # The captured decode steps would need the state rows in static buffers.
            raise UnsupportedSglangFeature(
                f"ATOM {self.entry.architecture} (Gated DeltaNet states) runs without CUDA "
                "graphs in SGLang: start it with disable_cuda_graph=True (--disable-cuda-graph)"
            )
        if capture_decode_batches_up_to(DECODE_GRAPH_MAX_BS):
            logger.info(
                "ATOM models capture decode CUDA graphs up to %d requests (atom_sglang.patches)",
                DECODE_GRAPH_MAX_BS,
            )
        logger.info(
            "ATOM %s (%s) built for SGLang: %d %s attention layers, kv pool %s, tp=%d/%d, "
            "dtype=%s%s",
            self.entry.architecture,
            self.entry.class_path,
            sum(isinstance(m, tuple(LAYER_FOR_ATTENTION.values())) for m in atom_model.modules()),
            self.adapter.attention,
            self.adapter.kv_pool,
            self.tp_group.rank,
            self.tp_group.world_size,
            torch.get_default_dtype(),
            f", quant={atom_quant.name}" if atom_quant is not None else "",
        )
        mla = [m.impl for m in atom_model.modules() if isinstance(m, SglangMLAAttention)]
        parts = mla_bytes_per_token(mla, torch.get_default_dtype())
        compressed = [
            m.impl for m in atom_model.modules() if isinstance(m, SglangCompressedAttention)
        ]
        pool_row = ""
        if compressed:  # DeepSeek-V4: its tensors packed into rows sized at page size 1
            parts = packed_bytes_per_token(compressed, 1, torch.get_default_dtype())
            # One pool width for every layer: the widest layer's (atom_sglang.patches, 12).
            width = max(packed_row_width(impl, 1) for impl in compressed)
            row_bytes = width * torch.get_default_dtype().itemsize * len(compressed)
            pool_row = f"; SGLang's MLA pool rows hold {row_bytes} B per token"
        if len(parts) > 1:  # several tensors share each token's pool row
            logger.info(
                "ATOM %s KV cache: %s%s",
                self.entry.architecture,
                bytes_per_token_line(parts),
                pool_row,
            )

    @property
    def model(self) -> nn.Module:
        return getattr(self, ATOM_MODEL_ATTR)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.model.embed_tokens

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights SGLang's EAGLE / NEXTN workers share with their draft model."""
        return self.model.model.embed_tokens.weight, self.model.lm_head.weight

    def get_attention_sliding_window_size(self) -> int | None:
        """The window SGLang's hybrid SWA pool keeps (SGLang asks its models for it): the
        sliding layers' RadixAttention window, in SGLang's convention (w + 1 keys), as its
        own models report it; None without sliding-window layers."""
        windows = {
            module.attn.sliding_window_size
            for module in self.modules()
            if isinstance(module, SglangAttention) and module.attn.sliding_window_size >= 0
        }
        if len(windows) > 1:
            raise UnsupportedSglangFeature(
                f"ATOM {self.entry.architecture}: SGLang's SWA pool keeps one window, the "
                f"layers have {sorted(windows)}"
            )
        return windows.pop() if windows else None

    def _check_kv_pool(self) -> None:
        is_mla = hasattr(get_token_to_kv_pool(), "kv_lora_rank")
        if is_mla != (self.adapter.kv_pool == "mla"):
            raise UnsupportedSglangFeature(
                f"ATOM {self.entry.architecture} needs an SGLang {self.adapter.kv_pool} KV "
                f"pool, SGLang allocated {type(get_token_to_kv_pool()).__name__}"
            )
        self._pool_checked = True

    def _bind_pools(self, backend: AtomAttnBackend) -> None:
        """ATOM's layers onto the pools of the backend that runs them, and each attention
        layer onto its KV-cache group (sliding-window layers: the sliding pool's tables)."""
        for module in self.model.modules():
            if isinstance(module, tuple(LAYER_FOR_ATTENTION.values())):
                layer_id = module.attn.layer_id
                module.bind_kv_pool(
                    backend.token_to_kv_pool, backend.page_size, backend.builder.kv_group(layer_id)
                )
            elif isinstance(module, SglangStateLayer):
                module.bind_state_pool(backend.req_to_token_pool)
        self._bound_to = backend

    def _step_context(self, forward_batch: Any):
        """ATOM's forward context for this step (see the module docstring)."""
        backend = atom_backend_of(get_attn_backend())
        if backend is None:
            if self.has_state_layers:
                raise NotImplementedError(
                    "ATOM's Gated DeltaNet layers in SGLang read their states through ATOM's "
                    f"attention backend (attention_backend='atom'); this engine runs "
                    f"{type(get_attn_backend()).__name__}"
                )
            return set_forward_context(None, host_attention=sglang_backend_attention(forward_batch))
        if self._bound_to is not backend:
            self._bind_pools(backend)
        return set_forward_context(backend.take_step(f"ATOM {self.entry.architecture}"))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: Any,
        input_embeds: torch.Tensor | None = None,
        get_embedding: bool = False,
        pp_proxy_tensors: Any = None,
        **kwargs: Any,
    ):
        if input_embeds is not None or get_embedding or pp_proxy_tensors is not None:
            raise UnsupportedSglangFeature(
                "ATOM models in SGLang take token ids and return logits (no input "
                "embeddings, embedding mode or pipeline parallelism)"
            )
        if not self._pool_checked:
            self._check_kv_pool()
        with self._step_context(forward_batch):
            hidden_states = self.model(input_ids, positions)
        return self.logits_processor(input_ids, hidden_states, self.model.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads SGLang's checkpoint iterator into the ATOM model; returns loaded names."""
        loaded = self.model.load_weights(take_kv_scales(self.model, weights))
        return {f"{ATOM_MODEL_ATTR}.{name}" for name in loaded}


_classes: dict[str, type[AtomForCausalLM]] = {}


def wrapper_class(architecture: str) -> type[AtomForCausalLM]:
    """The `AtomForCausalLM` subclass SGLang sees for `architecture` (made once)."""
    return architecture_subclass(AtomForCausalLM, architecture, __name__, "an SGLang", _classes)
