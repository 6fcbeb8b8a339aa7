"""The metadata bridge: SGLang's batch as ATOM's schema, through CUDA-graph buffers and the
hybrid SWA pool's translated tables."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from backend_fakes import (
    FakePool,
    fill_prefixes,
    history,
    layer,
    make_backend,
    make_batch,
    reference,
)
from plugin_logs import logged
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from atom.forward_context import set_forward_context
from atom.layers.attention_spec import AttentionSpec
from atom_sglang.attention_layer import SglangAttention


def test_decode_cuda_graph_metadata_matches_eager():
    """The static-buffer path (capture/replay) attends exactly like the eager one."""
    torch.manual_seed(1)
    hq, hkv, d, page = 4, 2, 32, 4
    prefix_lens, new_lens = [9, 30, 2], [1, 1, 1]
    req_to_token, batch = make_batch(prefix_lens, new_lens, page, 256)
    pool = FakePool(256, hkv, d, d, page)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    fill_prefixes(pool.k, pool.v, req_to_token, batch, hist, prefix_lens)
    q = torch.randn(3, hq, d)
    k_new = torch.stack([k[-1] for k, _ in hist])
    v_new = torch.stack([v[-1] for _, v in hist])
    backend = make_backend(req_to_token, pool, page)
    backend.init_forward_metadata(batch)
    eager = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d), batch
    )
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    backend.init_forward_metadata_out_graph(batch, in_capture=True)
    buffers = backend.builder.graph_buffers
    assert backend.step_metadata.block_table.data_ptr() == buffers["block_table"].data_ptr()
    graphed = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d), batch
    )
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    # A replay refills the buffers and keeps the metadata built at capture.
    captured = backend.step_metadata
    backend.init_forward_metadata_out_graph(batch)
    assert backend.step_metadata is captured


SLIDING_LAYER, FULL_LAYER = 0, 1


def hybrid_swa_batch(prefix_lens, new_lens, page_size, window, heads, dim):
    """A real SGLang hybrid SWA pool (layer 0 sliding, layer 1 full) and its allocator,
    holding requests as SGLang leaves them: both pools' slots allocated page by page and
    paired in the translation table, and the sliding slots of the tokens that no new
    query's window reaches freed again (`free_swa`, SGLang's out-of-window eviction).
    Returns the pool, its req_to_token table and a ForwardBatch-like step."""
    pool = SWAKVPool(
        size=256, size_swa=128, page_size=page_size, dtype=torch.float32, head_num=heads,
        head_dim=dim, swa_attention_layer_ids=[SLIDING_LAYER],
        full_attention_layer_ids=[FULL_LAYER], device="cpu",
    )  # fmt: skip
    allocator = SWATokenToKVPoolAllocator(
        256, 128, page_size, torch.float32, "cpu", pool, need_sort=False
    )
    allocator.swa_attn_allocator.alloc(3 * page_size)  # so the two pools' slots differ
    req_to_token = torch.zeros(8, 256, dtype=torch.int32)
    rows = [3, 1, 5][: len(prefix_lens)]
    new_slots = {}
    # Last request first: the translation is then no monotone function.
    for row, p, n in reversed(list(zip(rows, prefix_lens, new_lens))):
        pages = -(-(p + n) // page_size)
        full = allocator.full_attn_allocator.alloc(pages * page_size)
        allocator.set_full_to_swa_mapping(full, allocator.swa_attn_allocator.alloc(full.numel()))
        req_to_token[row, : p + n] = full[: p + n]
        new_slots[row] = full[p : p + n]
        # The first new token (position p) sees keys from p - window + 1 on.
        out_of_window = max(0, p - window + 1) // page_size * page_size
        allocator.free_swa(full[:out_of_window])
    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE if set(new_lens) == {1} else ForwardMode.EXTEND,
        batch_size=len(seq),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        out_cache_loc=torch.cat([new_slots[row] for row in rows]),
        extend_seq_lens=torch.tensor(new_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(new_lens),
    )
    return pool, req_to_token, batch


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "prefix_lens,new_lens", [([0, 13, 21], [9, 5, 1]), ([17, 30, 9], [1, 1, 1])]
)
def test_hybrid_swa_pool_sliding_layers_attend_in_the_sliding_pool(
    page_size, prefix_lens, new_lens, caplog
):
    """With SGLang's SWAKVPool, a sliding layer writes and reads the sliding-window pool
    through the translated metadata, a full layer the full pool; tokens whose sliding
    slots SGLang freed read its padding slot, which the window masks (filled with large
    values here, so reading it unmasked would show). Eager and CUDA-graph metadata."""
    torch.manual_seed(3)
    hq, hkv, d, window = 4, 2, 32, 6
    pool, req_to_token, batch = hybrid_swa_batch(prefix_lens, new_lens, page_size, window, hkv, d)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    translate = pool.translate_loc_from_full_to_swa
    for (k, v), row, p in zip(hist, batch.req_pool_indices.tolist(), prefix_lens):
        full = req_to_token[row, :p].long()
        pool.get_key_buffer(FULL_LAYER)[full] = k[:p]
        pool.get_value_buffer(FULL_LAYER)[full] = v[:p]
        kept = translate(full) > 0  # freed: translated to the padding slot 0
        sliding = translate(full[kept])
        pool.get_key_buffer(SLIDING_LAYER)[sliding] = k[:p][kept]
        pool.get_value_buffer(SLIDING_LAYER)[sliding] = v[:p][kept]
    # The padding page, which freed tokens' pages translate to.
    pool.get_key_buffer(SLIDING_LAYER)[:page_size] = 50.0
    pool.get_value_buffer(SLIDING_LAYER)[:page_size] = 50.0
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    with caplog.at_level(logging.INFO, logger="sglang.atom_sglang.backend"):
        backend = make_backend(req_to_token, pool, page_size)
    assert "hybrid SWA (full layers [1], sliding layers [0])" in logged(caplog)
    layers = {
        SLIDING_LAYER: layer(hq, hkv, d, d, window - 1, layer_id=SLIDING_LAYER),
        FULL_LAYER: layer(hq, hkv, d, d, layer_id=FULL_LAYER),
    }

    def attend(layer_id):
        return backend.forward(
            q.flatten(1), k_new.flatten(1), v_new.flatten(1), layers[layer_id], batch
        )

    backend.init_forward_metadata(batch)
    eager = {layer_id: attend(layer_id) for layer_id in layers}
    for layer_id, seen in ((SLIDING_LAYER, window), (FULL_LAYER, None)):
        want = reference(q, hist, prefix_lens, new_lens, d**-0.5, seen)
        torch.testing.assert_close(eager[layer_id].view_as(want), want, rtol=1e-5, atol=1e-5)
    sliding_slots = translate(batch.out_cache_loc)
    assert (sliding_slots > 0).all()
    torch.testing.assert_close(pool.get_key_buffer(SLIDING_LAYER)[sliding_slots], k_new)
    torch.testing.assert_close(pool.get_value_buffer(FULL_LAYER)[batch.out_cache_loc], v_new)
    # ATOM's own layers: the step's one metadata in ATOM's forward context, a sliding
    # layer reading its KV-cache group (the translated tables), the same results.
    for layer_id, seen in ((SLIDING_LAYER, window), (FULL_LAYER, None)):
        spec = AttentionSpec(
            f"model.layers.{layer_id}.self_attn.attn", hq, hkv, d, d, d**-0.5, sliding_window=seen
        )
        impl = SglangAttention(spec)
        impl.bind_kv_pool(pool, page_size, backend.builder.kv_group(layer_id))
        with set_forward_context(backend.step_metadata):
            out = impl(q, k_new.clone(), v_new, None)
        torch.testing.assert_close(out.view_as(eager[layer_id]), eager[layer_id], rtol=0, atol=0)
    if batch.forward_mode.is_decode():
        backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
        for layer_id in layers:
            torch.testing.assert_close(attend(layer_id), eager[layer_id], rtol=0, atol=0)
