"""ATOM's own MLA AttentionImpl: write the new latents into the paged cache, then attend."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from atom.forward_context import AttentionMetadata, get_forward_context
from atom.kernels import (
    absorb_query,
    expand_latent_output,
    indexer_topk,
    mla_attention,
    sparse_mla,
    write_indexer_keys,
    write_mla_cache,
)
from atom.kernels.few_queries import MAX_DECODE_QUERIES
from atom.kernels.policy import is_capturable
from atom.layers.attention_spec import AttentionSpec
from atom.layers.indexer import IndexerQuery


class NativeMLAImpl(nn.Module):
    """Latent cache layout: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].

    forward takes q_nope [T, H, Dn], q_pe [T, H, R] (rotated), kv_c [T, L] (normalised
    latent) and k_pe [T, R] (rotated) and returns [T, H, Dv]. W_UK / W_UV come from the
    spec's kv_b_proj once its weights are loaded (`process_weights_after_loading`).

    With an fp8 cache, `k_scale` is the one per-tensor scale of the latent rows (the
    checkpoint's `k_scale`, set by atom.loader, or 1.0); a checkpoint's `v_scale` is
    taken and not used (there are no separate values).

    A sparse spec (`index_topk`, DeepSeek Sparse Attention) adds an indexer key cache
    [num_blocks, block_size, index_head_dim] in the same pages (same block table and slot
    mapping), so it is sized, shared by prefix hits and freed with the latents.
    `select_tokens` writes a step's indexer keys and returns each token's top-k cache
    slots; `attend_selected` attends only to those (the `SparseMLAImpl` protocol). An fp8 cache holds the indexer
    keys in fp8 too, at scale 1.0 (they are LayerNorm'd).
    """

    # The ops of a captured step: their Triton kernels are capturable, the torch references
    # loop over host-side lengths. Up to MAX_DECODE_QUERIES tokens per sequence (a decode
    # or a speculative verify step) take the absorbed decode path, more the up-projected
    # prefill path.
    DECODE_OPS = ("write_mla_cache", "mla_decode_attention")
    PREFILL_OPS = ("write_mla_cache", "mla_prefill_attention")
    SPARSE_DECODE_OPS = (
        "write_mla_cache",
        "write_indexer_keys",
        "indexer_topk",
        "sparse_mla_attention",
    )

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        if spec.kv_b_proj is None:
            raise ValueError(f"{spec.layer_name}: an MLA spec needs its kv_b_proj")
        self.spec = spec
        self.nope_head_dim = spec.head_dim - spec.qk_rope_head_dim
        # The activation dtype, which the model is built under (weights may be FP8).
        self.dtype = torch.get_default_dtype()
        self.kv_cache: torch.Tensor | None = None
        self.index_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)

    @property
    def cuda_graph_safe(self) -> bool:
        return self.cuda_graph_safe_for(1)

    def cuda_graph_safe_for(self, query_tokens: int) -> bool:
        device = next(self.spec.kv_b_proj.parameters()).device
        if self.spec.index_topk:
            ops = self.SPARSE_DECODE_OPS  # the same ops for any number of tokens
        else:
            ops = self.DECODE_OPS if query_tokens <= MAX_DECODE_QUERIES else self.PREFILL_OPS
        return all(is_capturable(op, device) for op in ops)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        s = self.spec
        shapes = [(num_blocks, block_size, s.kv_lora_rank + s.qk_rope_head_dim)]
        if s.index_head_dim:
            shapes.append((num_blocks, block_size, s.index_head_dim))
        return shapes

    def kv_cache_labels(self) -> list[str]:
        """What each of kv_cache_shapes' tensors holds, for the start-up summary."""
        return ["MLA latents", "indexer keys"][: len(self.kv_cache_shapes(1, 1))]

    def bind_kv_cache(self, caches: Sequence[torch.Tensor], kv_group: int = 0) -> None:
        self.kv_cache, self.index_cache = (*caches, None)[:2]
        self.kv_group = kv_group

    def _step(self) -> AttentionMetadata:
        metadata = get_forward_context().attn_metadata
        if metadata is None or self.kv_cache is None:
            raise RuntimeError(
                f"{self.spec.layer_name}: attention needs a KV cache and step metadata "
                "(run the model under atom.forward_context.set_forward_context)"
            )
        return metadata.for_kv_group(self.kv_group)

    def select_tokens(self, index: IndexerQuery) -> torch.Tensor:
        """Writes the step's indexer keys, then each token's top-k cache slots [T, topk]."""
        if self.index_cache is None:
            raise RuntimeError(f"{self.spec.layer_name}: the layer keeps no indexer key cache")
        metadata = self._step()
        # A host may pad the batch past its metadata's tokens (vLLM's CUDA-graph batches):
        # the padding rows write no key and select nothing.
        n = metadata.num_tokens
        write_indexer_keys(index.k[:n], self.index_cache, metadata.slot_mapping)
        slots = torch.full(
            (index.q.shape[0], self.spec.index_topk), -1, dtype=torch.int32, device=index.q.device
        )
        indexer_topk(
            index.q[:n], index.weights[:n], self.index_cache, metadata, self.spec.index_topk,
            out=slots[:n],
        )  # fmt: skip
        return slots

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Splits kv_b_proj into w_uk [H, Dn, L] and w_uv [H, Dv, L] for this rank's heads.

        kv_b_proj is column-parallel over heads, so its local rows are whole heads. The
        weight is read by applying the layer to the identity: this gives the dense W^T
        whatever the layer's quantization (and is exact for unquantized weights).
        """
        s = self.spec
        device = next(s.kv_b_proj.parameters()).device
        identity = torch.eye(s.kv_lora_rank, dtype=self.dtype, device=device)
        weight = s.kv_b_proj(identity).T.reshape(s.num_heads, -1, s.kv_lora_rank)
        w_uk, w_uv = weight.split([self.nope_head_dim, s.v_head_dim], dim=1)
        self.w_uk, self.w_uv = w_uk.contiguous(), w_uv.contiguous()

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        return self.attend(q_nope, q_pe, kv_c, k_pe, self.kv_cache, self._step())

    def attend_selected(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        topk_slots: torch.Tensor,
    ) -> torch.Tensor:
        """forward's step over only each token's selected cache slots [T, topk]."""
        metadata = self._step()
        self._check_split()
        write_mla_cache(kv_c, k_pe, self.kv_cache, metadata.slot_mapping, kv_scale=self.k_scale)
        return sparse_mla(
            q_nope, q_pe, self.kv_cache, topk_slots, self.spec.scale, self.w_uk, self.w_uv,
            kv_scale=self.k_scale,
        )  # fmt: skip

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The MLA step over a cache and metadata the caller owns (a host's latent cache
        and its builder's metadata): latent write, then absorbed decode and up-projected
        prefill."""
        self._check_split()
        write_mla_cache(kv_c, k_pe, kv_cache, metadata.slot_mapping, kv_scale=self.k_scale)
        return mla_attention(
            q_nope, q_pe, kv_cache, metadata, self.spec.scale, self.w_uk, self.w_uv,
            kv_scale=self.k_scale,
        )  # fmt: skip

    def attend_through(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_attention: LatentAttention,
    ) -> torch.Tensor:
        """The MLA step with a host's own attention kernel, in the weight-absorbed form
        every host backend takes: q_nope through W_UK into the latent space, keys the
        cached latent + rope key, values the latent, the latent output through W_UV.
        `latent_attention(q [T, H, L + R], k [T, 1, L + R], v [T, 1, L])` writes k into
        the host's cache and returns [T, H, L]."""
        self._check_split()
        q = torch.cat([absorb_query(q_nope, self.w_uk), q_pe], dim=-1)
        k = torch.cat([kv_c, k_pe], dim=-1).unsqueeze(1)
        latent_out = latent_attention(q, k, kv_c.unsqueeze(1))
        return expand_latent_output(latent_out, self.w_uv)

    def _check_split(self) -> None:
        if self.w_uk is None:
            raise RuntimeError(
                f"{self.spec.layer_name}: kv_b_proj is not split yet "
                "(call atom.loader.process_weights_after_loading after loading weights)"
            )


LatentAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
