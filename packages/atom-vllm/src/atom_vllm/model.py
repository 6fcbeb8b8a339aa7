"""The model class vLLM instantiates for every architecture ATOM serves.

`register()` registers `"atom_vllm.model:<Architecture>"`; the module-level
`__getattr__` below makes that attribute a subclass of `AtomForCausalLM` bound to the
registry entry, so one generic class serves every architecture.

Per run, `model_config.model_impl` picks the implementation: "vllm" constructs vLLM's
own class for the architecture instead (from `__new__`, so vLLM gets its plain model
object); "auto", "atom" (or anything else) build ATOM's model:

* config bridge: `atom_vllm.config.bridge(vllm_config)` (hf_config, dtype, ATOM quant);
* TP: vLLM's tensor-parallel group installed as ATOM's (`atom.distributed.set_tp_group`),
  and with `enable_expert_parallel` as ATOM's expert-parallel group (`distributed.py`);
* attention: built inside `attention_backend(factory)`, so every ATOM attention layer
  owns a vLLM `Attention` layer on `AtomAttentionBackend` (MLA: `VllmMLAAttention`;
  DeepSeek-V4: `VllmCompressedAttention`);
* state (hybrid models): built inside `state_backend(factory)`, so every Gated DeltaNet
  layer owns a vLLM mamba layer (`atom_vllm.state_layer`) whose state cache vLLM's
  hybrid KV-cache manager allocates; `AtomHybridForCausalLM` answers vLLM's `IsHybrid`
  questions (state shapes, dtypes, copy functions) from the config;
* step: `forward` runs the ATOM model under ATOM's forward context holding the step's
  one complete metadata, which `atom_vllm.step.StepBridge` makes from vLLM's;
* LoRA: ATOM's layers take no adapters, so with `enable_lora` the class builds vLLM's own
  one (one log line); it carries vLLM's `SupportsLoRA` interface for that;
* EAGLE-3 (Llama, Qwen3 targets): `AtomEagle3TargetForCausalLM` is vLLM's
  `SupportsEagle3`, its forward adding the aux hidden states vLLM's drafter reads;
* weights: `load_weights` takes vLLM's iterator (the checkpoint is read once) and
  returns the names of the parameters it loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.interfaces import SupportsEagle3, supports_lora

from atom.config import SSM_CACHE_DTYPES
from atom.cuda_graphs import graph_blockers
from atom.hosts.cache_bytes import (
    bytes_per_token_line,
    mla_bytes_per_token,
    packed_bytes_per_token,
)
from atom.hosts.plugin import architecture_subclass
from atom.layers.attention import attention_backend
from atom.layers.gated_delta_net import config_state_shapes, state_backend
from atom.loader import process_weights_after_loading, take_kv_scales
from atom.registry import UnsupportedArchitectureError, get_entry
from atom.speculative.aux_hidden import AuxHiddenStates, default_aux_layer_ids
from atom.speculative.eagle3 import EAGLE3_TARGETS
from atom_vllm.attention_layer import VllmAttention, VllmMLAAttention, vllm_attention_factory
from atom_vllm.compressed_attention_layer import VllmCompressedAttention
from atom_vllm.config import AtomRunConfig, UnsupportedVllmFeature, bridge, vllm_own_reason
from atom_vllm.distributed import install_vllm_groups
from atom_vllm.patches import cuda_graphs_off, vllm_model_location
from atom_vllm.state_layer import VllmStateLayer, vllm_state_factory
from atom_vllm.step import StepBridge

logger = init_logger("vllm.atom_vllm.model")

ATOM_MODEL_ATTR = "atom_model"
# The layers the model's ATOM layers own in vLLM, each reading one KV-cache group.
ATOM_VLLM_LAYERS = (VllmAttention, VllmMLAAttention, VllmCompressedAttention, VllmStateLayer)


def vllm_model_class(architecture: str) -> type[nn.Module]:
    """vLLM's own class for an architecture (what ATOM's registration replaced)."""
    location = vllm_model_location(architecture)
    if location is None:
        raise UnsupportedVllmFeature(f"vLLM has no implementation of its own for {architecture}")
    module, class_name = location
    return getattr(importlib.import_module(module), class_name)


def vllm_own_model(architecture: str, vllm_config: Any, prefix: str, reason: str) -> nn.Module:
    """vLLM's own model for `architecture`, built where ATOM's is registered, with one log
    line saying why (`vllm_own_reason`)."""
    vllm_cls = vllm_model_class(architecture)
    logger.info(
        "%s: %s runs vLLM's %s.%s, not ATOM's",
        reason,
        architecture,
        vllm_cls.__module__,
        vllm_cls.__qualname__,
    )
    return vllm_cls(vllm_config=vllm_config, prefix=prefix)


class AtomForCausalLM(nn.Module):
    """vLLM's text-generation model interface around an ATOM model."""

    atom_architecture: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        reason = vllm_own_reason(vllm_config) if vllm_config is not None else None
        if reason is not None:
            prefix = kwargs.get("prefix", "")
            return vllm_own_model(cls.atom_architecture, vllm_config, prefix, reason)
        return super().__new__(cls)

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        super().__init__()
        self.run_config: AtomRunConfig = bridge(vllm_config, self.atom_architecture)
        cfg = self.run_config
        self.tp_group = install_vllm_groups(vllm_config)
        model_cls = cfg.entry.load_class()
        # vLLM's loader has set the default dtype and device for construction.
        with (
            attention_backend(vllm_attention_factory(vllm_config)),
            state_backend(vllm_state_factory(vllm_config), ssm_state_dtype(vllm_config)),
        ):
            atom_model = model_cls(cfg.hf_config, cfg.quant_config, prefix=prefix)
        setattr(self, ATOM_MODEL_ATTR, atom_model)
        self.step_bridge = StepBridge(
            [m for m in atom_model.modules() if isinstance(m, ATOM_VLLM_LAYERS)]
        )
        device = next(atom_model.parameters()).device
        blockers = graph_blockers(atom_model, device) if device.type == "cuda" else []
        if blockers:
            cuda_graphs_off(vllm_config, cfg.entry.architecture, blockers)
        layers = [m for m in atom_model.modules() if isinstance(m, AttentionLayerBase)]
        backends = sorted({m.get_attn_backend().__name__ for m in layers})
        logger.info(
            "ATOM %s (%s.%s) built for vLLM: %d attention layers on %s, tp=%d/%d, dtype=%s%s",
            cfg.entry.architecture,
            model_cls.__module__,
            model_cls.__qualname__,
            len(layers),
            ", ".join(backends) or "-",
            self.tp_group.rank,
            self.tp_group.world_size,
            cfg.dtype,
            f", quant={cfg.quant_config.name}" if cfg.quant_config is not None else "",
        )
        mla = [m for m in atom_model.modules() if isinstance(m, VllmMLAAttention)]
        parts = (
            mla_bytes_per_token((m.impl for m in mla), mla[0].kv_cache_torch_dtype) if mla else {}
        )
        compressed = [m for m in atom_model.modules() if isinstance(m, VllmCompressedAttention)]
        if compressed:  # DeepSeek-V4: several tensors packed into each layer's row
            parts = packed_bytes_per_token(
                (m.impl for m in compressed), compressed[0].block_size,
                compressed[0].kv_cache_torch_dtype,
            )  # fmt: skip
        if len(parts) > 1:  # sparse attention: the indexer keys share the latents' pages
            logger.info("ATOM %s KV cache: %s", cfg.entry.architecture, bytes_per_token_line(parts))

    @property
    def atom(self) -> nn.Module:
        """The ATOM causal LM this wrapper serves."""
        return getattr(self, ATOM_MODEL_ATTR)

    @property
    def model(self) -> nn.Module:
        """The ATOM model's decoder stack, under the name vLLM's models give theirs: vLLM's
        speculative proposers share the target's `model.embed_tokens` with an MTP drafter."""
        return self.atom.model

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.atom, "embed_input_ids", None)
        if callable(embed):
            return embed(input_ids)
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise UnsupportedVllmFeature("ATOM models in vLLM do not run pipeline parallel")
        if inputs_embeds is not None:
            raise UnsupportedVllmFeature(
                "ATOM models in vLLM take token ids, not inputs_embeds "
                "(prompt embeddings / multimodal inputs)"
            )
        with self.step_bridge.step(positions):
            return self.atom(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.atom.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads vLLM's checkpoint iterator into the ATOM model; returns loaded names."""
        loaded = self.atom.load_weights(take_kv_scales(self.atom, weights))
        process_atom_weights(self.atom)
        return {f"{ATOM_MODEL_ATTR}.{name}" for name in loaded}


def process_atom_weights(module: nn.Module) -> None:
    """ATOM's post-load hooks (e.g. FP8 re-layout, the MLA layers' W_UK / W_UV split),
    in ATOM's module order, except inside vLLM's own `Attention` layers: vLLM processes
    those itself, with its `act_dtype`. The MLA layers are ATOM's, so ATOM runs their
    hooks here, in ATOM's module order (vLLM's loader calls an `AttentionLayerBase`'s
    hook with an argument ATOM's layers do not take, and only after the quant hooks).
    """
    vllm_layers = [m for m in module.modules() if isinstance(m, Attention)]
    process_weights_after_loading(
        module, skip=[m for layer in vllm_layers for m in layer.modules()]
    )


def ssm_state_dtype(vllm_config: Any) -> torch.dtype:
    """The recurrent state dtype vLLM's `mamba_ssm_cache_dtype` means for ATOM's Gated
    DeltaNet ("auto": the model dtype, as vLLM keeps its own Gated DeltaNet's state; its
    Qwen3.5 config hook has already put the checkpoint's `mamba_ssm_dtype` there)."""
    value = str(vllm_config.cache_config.mamba_ssm_cache_dtype)
    return SSM_CACHE_DTYPES[value] or vllm_config.model_config.dtype


class AtomHybridForCausalLM(AtomForCausalLM):
    """An ATOM hybrid model (Gated DeltaNet + attention) for vLLM: `IsHybrid` and
    `HasInnerState` (vLLM reads these class attributes when it inspects the class)."""

    is_hybrid: ClassVar[Literal[True]] = True
    has_inner_state: ClassVar[Literal[True]] = True

    @classmethod
    def _state_shapes(cls, vllm_config: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        # ATOM's ops keep the conv state in the model dtype; the recurrent state may be
        # stored in any of SSM_CACHE_DTYPES (the math is fp32).
        if str(cache_config.mamba_cache_dtype) != "auto":
            raise UnsupportedVllmFeature(
                f"ATOM's {cls.atom_architecture} in vLLM does not support "
                f"mamba_cache_dtype={cache_config.mamba_cache_dtype!r} (supported: auto; "
                "mamba_ssm_cache_dtype sets the recurrent state's)"
            )
        return config_state_shapes(
            model_config.hf_text_config,
            vllm_config.parallel_config.tensor_parallel_size,
            model_config.dtype,
            ssm_state_dtype(vllm_config),
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for shape, _ in cls._state_shapes(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, dtype in cls._state_shapes(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        # Whole-state copies (vLLM's own for GDN: without speculative tokens each copies a
        # block's full state, whatever its layout). Used by the "align" cache mode only,
        # which atom_vllm.patches turns off for these models.
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set[Any]) -> dict[Any, tuple[Any, ...]]:
        return {mamba_type: cls.get_mamba_state_copy_func() for mamba_type in mamba_types}


class AtomEagle3TargetForCausalLM(AtomForCausalLM, SupportsEagle3):
    """An ATOM model vLLM's EAGLE-3 drafter reads: with aux layers set, `forward` returns
    the final hidden states and the residual streams at those layers
    (atom.speculative.aux_hidden, vLLM's convention), caught by hooks on ATOM's layers."""

    aux_hidden: AuxHiddenStates | None = None

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        if self.aux_hidden is not None:
            self.aux_hidden.remove()
        self.aux_hidden = AuxHiddenStates(self.model.layers, tuple(sorted(set(layers))))

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return default_aux_layer_ids(len(self.model.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args, **kwargs):
        hidden = super().forward(input_ids, positions, *args, **kwargs)
        if self.aux_hidden is None:
            return hidden
        return hidden, self.aux_hidden.take()


_classes: dict[str, type[AtomForCausalLM]] = {}


def wrapper_class(architecture: str) -> type[AtomForCausalLM]:
    """The `AtomForCausalLM` subclass vLLM sees for `architecture` (made once)."""
    base = AtomForCausalLM
    if get_entry(architecture).hybrid:
        base = AtomHybridForCausalLM
    elif architecture in EAGLE3_TARGETS:
        base = AtomEagle3TargetForCausalLM
    made = architecture in _classes
    cls = architecture_subclass(base, architecture, __name__, "a vLLM", _classes)
    if not made:
        _take_lora_interface(cls)
    return cls


def _take_lora_interface(cls: type[AtomForCausalLM]) -> None:
    """vLLM's own class's LoRA interface (`SupportsLoRA`) on the registered class, where
    vLLM's class has one. vLLM 0.33 refuses `enable_lora` unless the registered class
    supports LoRA, before it builds a model; a run with LoRA then builds vLLM's own class
    (`AtomForCausalLM.__new__`), whose packed modules these are. Every version also hands
    the registered class's `packed_modules_mapping` to its quantization config, which
    vLLM's own class (model_impl='vllm') reads and ATOM's model does not."""
    try:
        vllm_cls = vllm_model_class(cls.atom_architecture)
    except (UnsupportedVllmFeature, ImportError) as error:
        # No class of vLLM's own (then LoRA cannot run either way), or one whose module
        # does not import here (e.g. a multimodal one without torchvision).
        logger.debug("%s: no LoRA interface (%s)", cls.atom_architecture, error)
        return
    if not supports_lora(vllm_cls):
        return
    cls.supports_lora = True
    cls.packed_modules_mapping = vllm_cls.packed_modules_mapping
    cls.embedding_modules = vllm_cls.embedding_modules


def __getattr__(name: str) -> type[AtomForCausalLM]:
    # "atom_vllm.model:LlamaForCausalLM" -> the wrapper class for that architecture.
    try:
        return wrapper_class(name)
    except UnsupportedArchitectureError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
