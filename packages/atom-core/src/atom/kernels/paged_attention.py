"""Paged-KV attention for a mixed batch of decodes and prefills (docs/architecture.md).

The entry point takes the step in three objects, each one concept: the layer's cache
(`PagedKVCache`), the step (`AttentionMetadata`) and how scores are formed
(`AttentionScoring`, which `AttentionSpec.scoring` gives for a model's layer). The
registered torch / Triton implementations keep their flat argument lists: they are
launched (and tested, and benchmarked) directly, and the entry point unpacks once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.kv_cache import dequantize_kv, is_fp8_kv_cache
from atom.kernels.policy import dispatch, register


@dataclass(frozen=True)
class PagedKVCache:
    """One layer's key and value caches [num_blocks, block_size, Hkv, D|Dv], with an fp8
    cache's per-tensor scales (atom.kernels.kv_cache; 1.0 for a model-dtype cache)."""

    key: torch.Tensor
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class AttentionScoring:
    """How a query's scores over its keys are formed: `scale` times q.k, capped by
    `logits_soft_cap` (tanh) where set, masked to the last `sliding_window` positions
    (the query's own included) where set, with `sinks` [Hq] (GPT-OSS) joining each
    softmax as one more key without a value. Left out of ==: a tensor has no truth value."""

    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)


def gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, length: int, first_page: int = 0
) -> torch.Tensor:
    """Token rows [first_page * page_size, length) of a sequence's pages; the table entries
    before first_page are not read."""
    page_size = cache.shape[1]
    num_pages = -(-length // page_size)
    rows = cache[pages[first_page:num_pages].long()].flatten(0, 1)
    return rows[: length - first_page * page_size]


def first_window_page(context: int, sliding_window: int | None, page_size: int) -> int:
    """The first page a step's queries can see: with a window, the earliest query (at
    position `context`) sees no key below context - window + 1, and the native engine
    frees the pages before it (their table entries are placeholders)."""
    if sliding_window is None:
        return 0
    return max(0, context - sliding_window + 1) // page_size


def attention_mask(
    query_positions: torch.Tensor, length: int, sliding_window: int | None, first_key: int = 0
) -> torch.Tensor:
    """[q, length - first_key] True where a query may attend keys first_key.. (causal,
    optional sliding window)."""
    keys = torch.arange(first_key, length, device=query_positions.device)
    allowed = keys[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= keys[None, :] > query_positions[:, None] - sliding_window
    return allowed


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv], mask [n, m] -> [n, Hq, Dv] (fp32 math).

    sinks [Hq]: one logit per query head that joins the softmax as a key with no value
    (GPT-OSS), so a query may give part of its attention to nothing.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink_column], -1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@register("paged_attention", "torch")
def paged_attention_torch(
    query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
    key=None, value=None, sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The definition: every key from the cache (key/value hold the same new keys); with a
    window, from the first page the window reaches."""
    starts = metadata.host_query_start_loc()
    page_size = key_cache.shape[1]
    for i, seq_len in enumerate(metadata.host_seq_lens()):
        begin, end = starts[i], starts[i + 1]
        if end == begin:
            continue
        pages = metadata.block_table[i]
        context = seq_len - (end - begin)
        first_page = first_window_page(context, sliding_window, page_size)
        k = dequantize_kv(gather_pages(key_cache, pages, seq_len, first_page), k_scale)
        v = dequantize_kv(gather_pages(value_cache, pages, seq_len, first_page), v_scale)
        positions = torch.arange(context, seq_len, device=query.device)
        mask = attention_mask(positions, seq_len, sliding_window, first_page * page_size)
        out[begin:end] = dense_attention(
            query[begin:end], k, v, mask, scale, logits_soft_cap, sinks
        )
    return out


def paged_attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    metadata: AttentionMetadata,
    scoring: AttentionScoring,
    *,
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] against the cached K/V of each sequence -> [T, Hq, Dv].

    The new tokens' K/V must already be in the cache. New token j of a sequence with
    context c sits at position c + j and sees keys at positions <= c + j (and, with a
    sliding window w, > c + j - w). With a window, table entries of pages wholly before
    the earliest query's window (c - w + 1) are never read: the native engine frees those
    pages and leaves placeholders.

    new_kv, optional: those same new tokens' key [T, Hkv, D] and value [T, Hkv, Dv] as
    written to the cache (rotated, normalised), row t for query row t. A kernel may read
    the new keys from them instead of the pages (contiguous rows, no table lookups); the
    result is the same. An fp8 cache holds the new keys quantized, so unquantized `new_kv`
    is not handed on there: every key comes from the pages (read as cache * scale).
    """
    sinks = scoring.sinks
    if sinks is not None and sinks.shape != query.shape[1:2]:
        raise ValueError(
            f"sinks {tuple(sinks.shape)}: expected one per query head [{query.shape[1]}]"
        )
    if out is None:
        out = query.new_empty(query.shape[0], query.shape[1], cache.value.shape[-1])
    key, value = (None, None) if new_kv is None or is_fp8_kv_cache(cache.key) else new_kv
    return dispatch("paged_attention", query.device)(
        query, cache.key, cache.value, metadata, scoring.scale, scoring.sliding_window,
        scoring.logits_soft_cap, out, key, value,
        sinks=sinks, k_scale=cache.k_scale, v_scale=cache.v_scale,
    )  # fmt: skip
