"""SGLang's speculative decoding with ATOM's models as the target.

SGLang 0.5.21 and 0.5.23 offer it on CPU (EAGLE / NEXTN / NGRAM), but only through their CPU
kernel package `sgl_kernel`, which is not on PyPI: these tests run SGLang with a stub of it
(`sglang_cpu_support`), and every speculative engine stops in it (places in 0.5.21's
source):

* any speculative algorithm: the MHA / MLA pool's KV-copy warm-up
  (`mem_cache/kv_cache_configurator.py:1952` passes `enable_kv_cache_copy`,
  `mem_cache/memory_pool.py:2089` -> `_init_kv_copy_and_warmup` ->
  `kernels/ops/kvcache/cache_move.py:106`: `sgl_kernel.copy_all_layer_kv_cache_cpu`);
* then the draft tree and greedy verify (`speculative/eagle_utils.py:60-64`:
  `build_tree_kernel_efficient_cpu`, `verify_tree_greedy_cpu`), the draft's cache slots
  (`speculative/spec_utils.py:86`: `assign_extend_cache_locs_cpu`), and NGRAM's tree
  (`speculative/ngram_worker.py:46`: `sgl_kernel.speculative`);
* an EAGLE / NEXTN draft model's attention on CPU is SGLang's `intel_amx` backend only
  (`speculative/draft_utils.py`, `create_decode_backend` / `create_draft_extend_backend`),
  AMX kernels of the same package.

What is host-independent is ready and tested here without an engine: ATOM's backend
describes a verify step (TARGET_VERIFY, a chain of drafts) in ATOM's one schema, and
attends over it exactly as dense causal attention over context + drafts; a tree of
drafts and a draft model's steps are refused by name. The end-to-end test skips with the
reason above while `sgl_kernel` is the stub (`sglang_cpu_support`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sglang_cpu_support
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
from sglang.srt.model_executor.forward_batch_info import ForwardMode


def verify_batch(prefix_lens, drafts, page_size, tree_topk=1):
    """A TARGET_VERIFY step: SGLang's seq_lens stop before the `drafts` tokens per request."""
    req_to_token, batch = make_batch(prefix_lens, [drafts] * len(prefix_lens), page_size, 256)
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    batch.seq_lens = batch.seq_lens_cpu = torch.tensor(prefix_lens)
    batch.extend_seq_lens = batch.extend_seq_lens_cpu = None  # SGLang leaves them unset
    batch.spec_info = SimpleNamespace(tree_topk=tree_topk, draft_token_num=drafts)
    return req_to_token, batch


@pytest.mark.parametrize("page_size", [1, 4])
def test_verify_step_attends_causally_over_context_and_drafts(page_size):
    torch.manual_seed(0)
    hq, hkv, d, drafts = 4, 2, 32, 3
    prefix_lens = [5, 17, 1]
    req_to_token, batch = verify_batch(prefix_lens, drafts, page_size)
    pool = FakePool(256, hkv, d, d, page_size)
    backend = make_backend(req_to_token, pool, page_size)
    new_lens = [drafts] * len(prefix_lens)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    fill_prefixes(pool.k, pool.v, req_to_token, batch, hist, prefix_lens)
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    backend.init_forward_metadata(batch)
    md = backend.step_metadata
    assert md.query_start_loc.tolist() == [0, 3, 6, 9]
    assert md.seq_lens.tolist() == [p + drafts for p in prefix_lens]
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d), batch
    )
    want = reference(q, hist, prefix_lens, new_lens, d**-0.5)
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.k[batch.out_cache_loc], k_new)


def test_tree_of_drafts_and_draft_model_steps_are_refused_by_name():
    req_to_token, batch = verify_batch([4, 9], 4, 1, tree_topk=-1)  # NGRAM's irregular tree
    backend = make_backend(req_to_token, FakePool(256, 2, 32, 32, 1), 1)
    with pytest.raises(NotImplementedError, match="speculative_eagle_topk=1"):
        backend.init_forward_metadata(batch)
    batch.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    with pytest.raises(NotImplementedError, match="speculative_draft_attention_backend"):
        backend.init_forward_metadata(batch)


def test_engine_runs_wait_for_sglangs_cpu_kernels():
    """The end-to-end comparison (GLM-4.5 with its MTP layer, NEXTN with
    speculative_eagle_topk=1, ATOM's target against SGLang's own) needs SGLang's CPU
    kernels; with the stub, every speculative engine stops at the first of them."""
    from sglang.kernels.ops.kvcache import cache_move

    if sglang_cpu_support.is_stub(cache_move.copy_all_layer_kv_cache_cpu):
        pytest.skip(
            "SGLang runs speculative decoding on CPU only with its sgl_kernel CPU ops "
            "(first: copy_all_layer_kv_cache_cpu, the KV pool's copy warm-up); "
            "sgl_kernel is not on PyPI and is a stub here"
        )
    pytest.fail("SGLang's CPU kernels are installed: add the engine runs")
