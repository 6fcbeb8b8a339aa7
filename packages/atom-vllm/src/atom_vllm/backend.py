"""ATOM's attention backends for vLLM: capabilities, metadata builder, MHA impl.

* `AtomAttentionBackend` declares what the backend supports. vLLM owns the KV-cache
  layout: each layer gets a logical `[num_blocks, num_kv_heads, block_size, D + Dv]`
  view (K and V side by side in the last dim) in whichever physical layout the engine
  picked; `key_value_caches` turns it into the `[num_blocks, block_size, Hkv, D|Dv]`
  key/value views ATOM's kernels take (they read strides, so any layout works).
* `AtomAttentionMetadataBuilder` turns vLLM's `CommonAttentionMetadata` into
  `atom.forward_context.AttentionMetadata`, the schema every ATOM host fills. It asks
  vLLM to put decodes first (`reorder_batch_threshold = 1`).
* `AtomAttentionImpl.forward` runs the step of ATOM's native impl
  (`atom.layers.paged_attention_impl.write_kv_and_attend`): the model's q/k norm + rotary
  fused with the KV-cache write, then paged attention (the kernel policy picks torch on
  CPU, Triton on GPU).

vLLM's `Attention` layer drives all of it: it allocates and binds the KV cache from the
layer's spec, builds one metadata object per step and KV-cache group, and calls the impl.
The impl reads the step from ATOM's forward context, where the model wrapper put the
step's one complete metadata (`atom_vllm.step`), as every ATOM impl does.
The backend is registered under the static `AttentionBackendEnum.CUSTOM` member, so
`get_name()` returns "CUSTOM" (vLLM's `Attention` looks the name up in that enum).

`AtomMLABackend` declares ATOM's MLA path: the same builder and schema; its layer
(`atom_vllm.attention_layer.VllmMLAAttention`) runs ATOM's MLA impl itself.
`AtomCompressedBackend` does the same for DeepSeek-V4's layers
(`atom_vllm.compressed_attention_layer.VllmCompressedAttention`).

`AtomStateBackend` serves the state caches of hybrid models' Gated DeltaNet layers
(`atom_vllm.state_layer.VllmStateLayer`): its builder reads a mamba KV-cache group's
`CommonAttentionMetadata`, whose block table holds one block per request (vLLM's
mamba cache mode "none"), and gives ATOM's schema with that block as the request's
`state_slots` row and `has_initial_state` from its computed tokens
(`atom.hosts.state.with_state_slots`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from atom.forward_context import AttentionMetadata, get_forward_context
from atom.hosts.state import with_state_slots
from atom.kernels import PagedKVCache
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE, fp8_kv_cache_unsupported
from atom.layers.attention_spec import AttentionSpec
from atom.layers.paged_attention_impl import write_kv_and_attend

BACKEND_NAME = "CUSTOM"  # the AttentionBackendEnum member register() overrides
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp16", "bf16")
# vLLM's names of the float8_e4m3fn cache ATOM's MHA and MLA kernels read (atom.kernels.kv_cache);
# vLLM allocates it as uint8.
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")


class AtomBackendCapabilities(AttentionBackend):
    """What ATOM's MHA and MLA backends both declare to vLLM."""

    # The impl writes the KV cache itself, at the start of forward (as ATOM's native impl).
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES


class AtomAttentionBackend(AtomBackendCapabilities):
    """Declares capabilities; the work is in the builder and the impl."""

    @staticmethod
    def get_impl_cls() -> type[AtomAttentionImpl]:
        return AtomAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AtomAttentionMetadataBuilder]:
        return AtomAttentionMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


def cache_dtype_problem(kv_cache_dtype: str) -> str | None:
    """Why ATOM's kernels cannot run a vLLM KV cache of `kv_cache_dtype` here, or None."""
    if kv_cache_dtype in PLAIN_CACHE_DTYPES:
        return None
    if kv_cache_dtype not in FP8_CACHE_DTYPES:
        supported = ", ".join(PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES)
        return f"kv_cache_dtype={kv_cache_dtype!r} (supported: {supported})"
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return fp8_kv_cache_unsupported(device)


def key_value_caches(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `[num_blocks, block_size, Hkv, D|Dv]` key and value views of a layer's
    `[num_blocks, Hkv, block_size, D + Dv]` cache."""
    tokens_major = kv_cache.transpose(1, 2)
    return tokens_major[..., :head_size], tokens_major[..., head_size:]


def to_atom_metadata(cm: CommonAttentionMetadata) -> AttentionMetadata:
    """vLLM's per-step `CommonAttentionMetadata` as ATOM's schema (decodes first)."""
    num_reqs = cm.num_reqs
    num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(cm, decode_threshold=1)
    on_host = cm.seq_lens.device.type == "cpu"
    return AttentionMetadata(
        query_start_loc=cm.query_start_loc[: num_reqs + 1],
        seq_lens=cm.seq_lens[:num_reqs],
        block_table=cm.block_table_tensor[:num_reqs],
        slot_mapping=cm.slot_mapping[: cm.num_actual_tokens],
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        max_query_len=cm.max_query_len,
        max_seq_len=cm.max_seq_len,
        query_start_loc_cpu=cm.query_start_loc_cpu[: num_reqs + 1],
        seq_lens_cpu=cm.seq_lens[:num_reqs] if on_host else None,
        positions=cm.positions,
    )


class AtomAttentionMetadataBuilder(AttentionMetadataBuilder[AttentionMetadata]):
    # The Triton decode kernel's launch grid depends only on the batch size, and it
    # reads seq_lens / block_table from vLLM's persistent buffers: pure-decode batches
    # can be captured in CUDA graphs. Mixed batches size their grids from host values.
    # (A model with uncapturable ATOM ops turns CUDA graphs off in its own config:
    # atom_vllm.model.)
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttentionMetadata:
        return to_atom_metadata(common_attn_metadata)


class AtomAttentionImpl(AttentionImpl[AttentionMetadata]):
    """Writes K/V into the paged cache, then ATOM's paged attention over it.

    vLLM constructs it from its `Attention` layer's arguments, which are checked here;
    what the attention computes comes from ATOM's `AttentionSpec`, which `VllmAttention`
    hands it by reference (`spec`) right after: window, soft cap, sinks and the model's
    q/k norm + rotary (`qk_rope`). The step comes from ATOM's forward context (this
    layer's KV-cache group, `kv_group`, as `atom_vllm.step` numbers them). vLLM's
    attention op passes only q, k and v: for a layer with `qk_rope`, q and k arrive raw
    and are rotated with the step metadata's `positions` in the same kernel that writes
    the cache.

    With an fp8 cache (`kv_cache_dtype` "fp8"/"fp8_e4m3") the kernels quantize on write
    and dequantize on read with the layer's per-tensor `k_scale` / `v_scale`: 1.0, or the
    checkpoint's, which `atom.loader.take_kv_scales` hands over through `VllmAttention`.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args,
    ) -> None:
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("KV sharing between layers")
        problem = cache_dtype_problem(kv_cache_dtype)
        if problem:
            unsupported.append(problem)
        if unsupported:
            raise NotImplementedError(
                "ATOM's attention backend does not support " + ", ".join(unsupported)
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.spec: AttentionSpec | None = None  # ATOM's, set by its VllmAttention
        self.kv_group = 0  # set by atom_vllm.step
        self.num_calls = 0  # for tests and logs: proof that this impl ran
        self.fp8_cache = kv_cache_dtype in FP8_CACHE_DTYPES
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D|Dv] -> output [T, Hq, Dv] (in place).

        `attn_metadata`, vLLM's view of the same step (this group's builder output), is
        not read: the step is ATOM's forward context's. vLLM may pad the batch past the
        metadata's tokens: only slot_mapping's are written.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ATOM's attention backend has no fused output quantization")
        step = get_forward_context().attn_metadata
        if step is None:  # profiling / dummy run: no cache, no metadata
            return output
        metadata = step.for_kv_group(self.kv_group)
        self.num_calls += 1
        if self.fp8_cache:
            kv_cache = kv_cache.view(FP8_KV_CACHE_DTYPE)
        cache = PagedKVCache(
            *key_value_caches(kv_cache, self.head_size), self.k_scale, self.v_scale
        )
        return write_kv_and_attend(
            query, key, value, cache, metadata, self.spec, metadata.positions, out=output
        )


class AtomMLAMetadataBuilder(AtomAttentionMetadataBuilder):
    """The MHA builder: MLA reads the same attention-metadata schema (docs/architecture.md)."""


class AtomMLABackend(AtomBackendCapabilities):
    """Capabilities of ATOM's MLA path; the layer runs ATOM's impl itself."""

    @staticmethod
    def get_impl_cls():
        # vLLM's AttentionImpl interface is not used: VllmMLAAttention runs ATOM's impl.
        raise NotImplementedError("ATOM's MLA layer runs atom.layers.mla_impl.NativeMLAImpl")

    @staticmethod
    def get_builder_cls() -> type[AtomMLAMetadataBuilder]:
        return AtomMLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True


class AtomCompressedBackend(AtomBackendCapabilities):
    """Capabilities of ATOM's DeepSeek-V4 attention path: the MHA builder and schema; the
    layer (`atom_vllm.compressed_attention_layer.VllmCompressedAttention`) runs ATOM's
    impl itself."""

    @staticmethod
    def get_impl_cls():
        # vLLM's AttentionImpl interface is not used: the layer runs ATOM's impl.
        raise NotImplementedError(
            "ATOM's DeepSeek-V4 layer runs atom.layers.compressed_attention_impl"
        )

    @staticmethod
    def get_builder_cls() -> type[AtomAttentionMetadataBuilder]:
        return AtomAttentionMetadataBuilder


class AtomStateMetadataBuilder(AtomAttentionMetadataBuilder):
    """ATOM's schema for a mamba KV-cache group: the MHA fields plus each request's state
    row (its one block) and whether that row holds its state."""

    # Decode steps read per-request rows from vLLM's persistent block table, as attention
    # decodes do; mixed batches size the ops' loops from host values.
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        mode = vllm_config.cache_config.mamba_cache_mode
        if mode != "none":  # patch 3 turns prefix caching off for ATOM's hybrid models
            # vLLM derives the mode from enable_prefix_caching ("align" when on); 0.33
            # ignores --mamba-cache-mode.
            raise NotImplementedError(
                "ATOM's state backend needs mamba_cache_mode='none' (prefix caching off), "
                f"got {mode!r}"
            )
        if getattr(kv_cache_spec, "num_speculative_blocks", 0):
            # Draft tokens would need a state block each; ATOM keeps one per request.
            raise NotImplementedError(
                "ATOM's hybrid models in vLLM run without speculative decoding "
                f"(num_speculative_tokens={vllm_config.num_speculative_tokens})"
            )
        # A captured decode step reads has_initial_state from the address it saw at
        # capture (the other fields are views of vLLM's persistent buffers).
        scheduler = vllm_config.scheduler_config
        max_reqs = max(  # padded capture batches may exceed max_num_seqs
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            vllm_config.compilation_config.max_cudagraph_capture_size or 0,
        )
        self.has_initial_state = torch.zeros(max_reqs, dtype=torch.bool, device=device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttentionMetadata:
        cm = common_attn_metadata
        metadata = with_state_slots(
            to_atom_metadata(cm), cm.block_table_tensor[:, 0], cm.compute_num_computed_tokens()
        )
        static = self.has_initial_state[: metadata.num_seqs]
        metadata.has_initial_state = static.copy_(metadata.has_initial_state)
        return metadata


class AtomStateBackend(AttentionBackend):
    """The state caches of ATOM's Gated DeltaNet layers (vLLM's SSM kind of backend)."""

    @staticmethod
    def get_name() -> str:
        return "ATOM_STATE"

    @staticmethod
    def get_builder_cls() -> type[AtomStateMetadataBuilder]:
        return AtomStateMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True
