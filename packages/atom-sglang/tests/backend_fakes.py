"""SGLang's pool and batch for the backend tests: fake pools, ForwardBatch-like steps and
the dense-attention reference they are checked against."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from atom.kernels.paged_attention import attention_mask, dense_attention
from atom_sglang.backend import AtomAttnBackend


class FakePool:
    """SGLang's pool interface over flat [slots, H, D] tensors (slot 0 = padding)."""

    dtype = torch.float32

    def __init__(self, slots, heads, dim, v_dim, page_size, mla_latent=None):
        self.page_size = page_size
        if mla_latent is not None:
            self.kv_lora_rank = mla_latent
            self.kv = torch.zeros(slots, 1, dim)
        else:
            self.k, self.v = torch.zeros(slots, heads, dim), torch.zeros(slots, heads, v_dim)

    def get_key_buffer(self, layer_id):
        return self.kv if hasattr(self, "kv_lora_rank") else self.k

    def get_value_buffer(self, layer_id):
        return self.kv[..., : self.kv_lora_rank] if hasattr(self, "kv_lora_rank") else self.v


def make_batch(prefix_lens, new_lens, page_size, num_slots, seed=0):
    """A req_to_token table with shuffled page-aligned slots and a ForwardBatch-like step."""
    rng = random.Random(seed)
    pages = list(range(1, num_slots // page_size))  # page 0 holds the padding slot
    rng.shuffle(pages)
    req_to_token = torch.zeros(8, 256, dtype=torch.int32)
    rows = [3, 1, 5, 0, 6, 2][: len(prefix_lens)]
    out_loc = []
    for row, p, n in zip(rows, prefix_lens, new_lens):
        table = [pages.pop() for _ in range(-(-(p + n) // page_size))]
        slots = [table[i // page_size] * page_size + i % page_size for i in range(p + n)]
        req_to_token[row, : p + n] = torch.tensor(slots, dtype=torch.int32)
        out_loc += slots[p:]
    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    decode = all(n == 1 for n in new_lens) and all(p > 0 for p in prefix_lens)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=len(seq),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        out_cache_loc=torch.tensor(out_loc),
        extend_seq_lens=torch.tensor(new_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(new_lens),
        # ForwardBatch's default: no padding of the step's tokens (MLP sync). SGLang
        # 0.5.23's RadixAttention reads it on every extend step.
        global_num_token_non_padded_cpu=None,
    )
    return req_to_token, batch


def make_backend(req_to_token, pool, page_size):
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool,
        page_size=page_size,
    )
    return AtomAttnBackend(runner)


def layer(hq, hkv, d, dv, window=-1, cap=0.0, layer_id=0):
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=hq, tp_k_head_num=hkv, tp_v_head_num=hkv, qk_head_dim=d,
        v_head_dim=dv, scaling=d**-0.5, sliding_window_size=window, logit_cap=cap,
        logit_capping_method="tanh", k_scale_float=None, v_scale_float=None,
    )  # fmt: skip


def history(prefix_lens, new_lens, heads, d, dv):
    return [
        (torch.randn(p + n, heads, d), torch.randn(p + n, heads, dv))
        for p, n in zip(prefix_lens, new_lens)
    ]


def reference(q, hist, prefix_lens, new_lens, scale, window=None, cap=None):
    outs, start = [], 0
    for (k, v), p, n in zip(hist, prefix_lens, new_lens):
        mask = attention_mask(torch.arange(p, p + n), p + n, window)
        outs.append(dense_attention(q[start : start + n], k, v, mask, scale, cap))
        start += n
    return torch.cat(outs)


def fill_prefixes(pool_k, pool_v, req_to_token, batch, hist, prefix_lens):
    for row, (k, v), p in zip(batch.req_pool_indices.tolist(), hist, prefix_lens):
        slots = req_to_token[row, :p].long()
        pool_k[slots] = k[:p]
        if pool_v is not None:
            pool_v[slots] = v[:p]
