"""NativeMLAImpl's sparse step when a host pads the batch past its metadata's tokens
(vLLM's CUDA-graph batches): the real tokens select as without padding, the padding rows
write no indexer key and select nothing."""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import set_forward_context
from atom.layers.attention_spec import AttentionSpec
from atom.layers.indexer import IndexerQuery
from atom.layers.mla_impl import NativeMLAImpl
from tests.kernels.dsa_batches import INDEX_DIM, INDEX_HEADS, PagedBatch

TOPK, LATENT, ROPE, PADDING = 4, 32, 8, 3


def sparse_impl(batch: PagedBatch) -> NativeMLAImpl:
    spec = AttentionSpec(
        layer_name="attn", num_heads=2, num_kv_heads=1, head_dim=16 + ROPE, v_head_dim=16,
        scale=1.0, kind="MLA", kv_lora_rank=LATENT, qk_rope_head_dim=ROPE,
        kv_b_proj=nn.Linear(LATENT, 2 * 32, bias=False), index_topk=TOPK,
        index_head_dim=INDEX_DIM,
    )  # fmt: skip
    impl = NativeMLAImpl(spec)
    impl.bind_kv_cache([batch.nan_pool(LATENT + ROPE), torch.zeros_like(batch.nan_pool(INDEX_DIM))])
    return impl


def test_padding_rows_write_no_key_and_select_nothing():
    batch = PagedBatch([(3, 1), (0, 6)], 4)
    metadata = batch.metadata()
    tokens = metadata.num_tokens
    q = batch.randn(tokens + PADDING, INDEX_HEADS, INDEX_DIM)
    k = batch.randn(tokens + PADDING, INDEX_DIM)
    w = batch.randn(tokens + PADDING, INDEX_HEADS).float()
    selections = []
    for rows in (tokens, tokens + PADDING):
        impl = sparse_impl(batch)
        with set_forward_context(metadata):
            selections.append(impl.select_tokens(IndexerQuery(q[:rows], k[:rows], w[:rows])))
        written = impl.index_cache.flatten(0, 1).abs().sum(-1).gt(0).sum()
        assert written == tokens  # each real token's key, no padding row's
    exact, padded = selections
    assert torch.equal(padded[:tokens], exact) and padded[tokens:].eq(-1).all()
