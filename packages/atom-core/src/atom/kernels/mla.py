"""Multi-head latent attention (DeepSeek MLA) over a paged latent cache (docs/architecture.md).

Each cached token is one row of kv_lora_rank + qk_rope_head_dim channels: the normalised
latent c (L channels) followed by the rotated rope key k_pe (R channels), shared by all
heads. Head h attends keys [W_UK[h] c, k_pe] and values W_UV[h] c, where
w_uk [H, Dn, L] and w_uv [H, Dv, L] are the two halves of kv_b_proj's weight.

As in vLLM, there are two exact ways to attend:
- decode (weight-absorbed): q_nope is folded through W_UK into the latent space, so the
  step is MQA with head dim L + R straight over the cache, and the latent output goes
  through W_UV. No per-head K/V is materialised, so the cache is read once per step.
- prefill (up-projected): each sequence's cached latents are expanded to per-head k_nope
  and v, then ordinary attention with head dim Dn + R; cheaper when many queries share
  the keys.
Both read the cache through `block_table`, so a prefill with a cached prefix sees it.

An fp8 latent cache (float8_e4m3fn) holds rows / kv_scale, one scale per layer
(atom.kernels.kv_cache); keys and values are read as cache * kv_scale.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.few_queries import few_queries_as_decodes
from atom.kernels.kv_cache import dequantize_kv, quantize_kv
from atom.kernels.paged_attention import (
    AttentionScoring,
    PagedKVCache,
    attention_mask,
    dense_attention,
    gather_pages,
    paged_attention,
)
from atom.kernels.policy import dispatch, register


def sequence_spans(
    metadata: AttentionMetadata, first: int, last: int
) -> Iterator[tuple[int, int, int, int]]:
    """(sequence, query row begin, end, seq_len) of sequences [first, last) with new tokens.

    Rows count from the first query row of sequence `first`, because each path receives
    only its own slice of the batch's queries.
    """
    starts = metadata.host_query_start_loc()
    seq_lens = metadata.host_seq_lens()
    base = starts[first]
    for i in range(first, last):
        if starts[i + 1] > starts[i]:
            yield i, starts[i] - base, starts[i + 1] - base, seq_lens[i]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, Dn] folded through W_UK into the latent space: [T, H, L]."""
    return torch.einsum("thd,hdl->thl", q_nope, w_uk)


def expand_latent_output(latent_out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """An absorbed step's latent output [T, H, L] through W_UV: [T, H, Dv]."""
    return torch.einsum("thl,hvl->thv", latent_out, w_uv)


def query_positions(begin: int, end: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(seq_len - (end - begin), seq_len, device=device)


@register("write_mla_cache", "torch")
def write_mla_cache_torch(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=1.0) -> None:
    block_size = kv_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    rows = torch.cat([kv_c[valid], k_pe[valid]], dim=-1)
    kv_cache[slots // block_size, slots % block_size] = quantize_kv(rows, kv_scale, kv_cache.dtype)


def write_mla_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float = 1.0,
) -> None:
    """kv_c [T, L] and k_pe [T, R] into kv_cache [num_blocks, block_size, L + R].

    Slot s is block s // block_size, offset s % block_size; slot -1 marks padding.
    kv_scale: an fp8 cache's per-tensor scale (see the module docstring).
    """
    dispatch("write_mla_cache", kv_c.device)(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)


def _cached_rows(kv_cache, table_row, seq_len, kv_scale, dtype) -> torch.Tensor:
    return dequantize_kv(gather_pages(kv_cache, table_row, seq_len), kv_scale).to(dtype)


@register("mla_decode_attention", "torch")
def mla_decode_attention_torch(q_latent, q_pe, kv_cache, metadata, scale, out, kv_scale=1.0):
    latent_dim = q_latent.shape[-1]
    query = torch.cat([q_latent, q_pe], dim=-1)
    for i, begin, end, seq_len in sequence_spans(metadata, 0, metadata.num_decodes):
        rows = _cached_rows(kv_cache, metadata.block_table[i], seq_len, kv_scale, query.dtype)
        kv = rows.unsqueeze(1)
        mask = attention_mask(query_positions(begin, end, seq_len, query.device), seq_len, None)
        out[begin:end] = dense_attention(
            query[begin:end], kv, kv[..., :latent_dim], mask, scale, None
        )
    return out


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Latent-space MQA for the decode sequences (the first `num_decodes`) -> [Td, H, L].

    q_latent [Td, H, L] is q_nope already absorbed through W_UK, q_pe [Td, H, R] the rotated
    rope part; Td = num_decode_tokens. Keys are whole cache rows, values their first L
    channels. The output is still latent: project it through W_UV.
    """
    if out is None:
        out = q_latent.new_empty(q_latent.shape)
    return dispatch("mla_decode_attention", q_latent.device)(
        q_latent, q_pe, kv_cache, metadata, scale, out, kv_scale
    )


@register("mla_prefill_attention", "torch")
def mla_prefill_attention_torch(
    q_nope, q_pe, kv_cache, metadata, scale, w_uk, w_uv, out, kv_scale=1.0
):
    num_heads, _, latent_dim = w_uk.shape
    query = torch.cat([q_nope, q_pe], dim=-1)
    for i, begin, end, seq_len in sequence_spans(metadata, metadata.num_decodes, metadata.num_seqs):
        rows = _cached_rows(kv_cache, metadata.block_table[i], seq_len, kv_scale, torch.float32)
        kv_c, k_pe = rows[:, :latent_dim], rows[:, latent_dim:]
        k_nope = torch.einsum("ml,hdl->mhd", kv_c, w_uk.float())
        value = torch.einsum("ml,hdl->mhd", kv_c, w_uv.float())
        key = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)], dim=-1)
        mask = attention_mask(query_positions(begin, end, seq_len, query.device), seq_len, None)
        out[begin:end] = dense_attention(query[begin:end], key, value, mask, scale, None)
    return out


def mla_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Up-projected attention for the prefill sequences (after the decodes) -> [Tp, H, Dv].

    q_nope [Tp, H, Dn] and q_pe [Tp, H, R] are the queries from row num_decode_tokens on.
    Every sequence's latents (cached prefix and new tokens) are read from the cache.
    """
    if out is None:
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    return dispatch("mla_prefill_attention", q_nope.device)(
        q_nope, q_pe, kv_cache, metadata, scale, w_uk, w_uv, out, kv_scale
    )


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """MLA for a mixed, decode-first batch: q_nope [T, H, Dn], q_pe [T, H, R] -> [T, H, Dv].

    The new tokens' latents must already be in the cache (`write_mla_cache`). Decode rows
    (and a step of the same few tokens per sequence) take the absorbed path, prefill rows
    the up-projected one.
    """
    if out is None:
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    metadata = few_queries_as_decodes(metadata)
    num_decode_tokens = metadata.num_decode_tokens
    if metadata.num_decodes:
        q_latent = absorb_query(q_nope[:num_decode_tokens], w_uk)
        latent_out = mla_decode_attention(
            q_latent, q_pe[:num_decode_tokens], kv_cache, metadata, scale, kv_scale=kv_scale
        )
        out[:num_decode_tokens] = expand_latent_output(latent_out, w_uv)
    if metadata.num_prefills:
        mla_prefill_attention(
            q_nope[num_decode_tokens:],
            q_pe[num_decode_tokens:],
            kv_cache,
            metadata,
            scale,
            w_uk,
            w_uv,
            out=out[num_decode_tokens:],
            kv_scale=kv_scale,
        )
    return out


def mla_latent_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    latent_dim: int,
    *,
    out: torch.Tensor | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Weight-absorbed MLA for a whole batch: q [T, H, L + R] (q_nope already through
    W_UK, then q_pe) -> the latent output [T, H, L]. Keys are whole cache rows, values
    their first L channels. For a host's own MLA layers, which hand over absorbed queries
    (SGLang's DeepSeek); ATOM's layers run `mla_attention`, whose prefill up-projects."""
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], latent_dim)
    if metadata.num_decodes == metadata.num_seqs:
        return mla_decode_attention(
            q[..., :latent_dim], q[..., latent_dim:], kv_cache, metadata, scale,
            out=out, kv_scale=kv_scale,
        )  # fmt: skip
    keys = kv_cache.unsqueeze(2)  # the same latent-space MQA for every new token
    latent_cache = PagedKVCache(keys, keys[..., :latent_dim], kv_scale, kv_scale)
    return paged_attention(q, latent_cache, metadata, AttentionScoring(scale), out=out)
