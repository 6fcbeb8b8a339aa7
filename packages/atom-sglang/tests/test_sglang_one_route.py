"""One route (docs/architecture.md, "A decode step, host by host"): ATOM's layers in
SGLang read the step only from ATOM's forward context, whether ATOM's backend attends
(the step's metadata) or SGLang's own does (the bridge's `HostAttention`, which alone
holds the batch). A batch that records who reads its fields sees only SGLang's code and
the bridge's builder; both routes give the same output and cache."""

from __future__ import annotations

import sys

import pytest
import torch
from backend_fakes import FakePool, make_backend, make_batch
from sglang.srt.model_executor.forward_context import ForwardContext as SglangContext
from sglang.srt.model_executor.forward_context import forward_context as sglang_context
from torch import nn

from atom.forward_context import set_forward_context
from atom.layers.attention_spec import AttentionSpec, QKRope
from atom.layers.norm import RMSNorm
from atom.layers.rotary import RotaryEmbedding
from atom_sglang.attention_layer import SglangAttention, SglangMLAAttention
from atom_sglang.model import sglang_backend_attention

# The only code that may read SGLang's batch: SGLang's own and the bridge's builder.
BATCH_READERS = ("sglang.", "atom_sglang.metadata")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
NOPE, ROPE, V_DIM, LATENT = 16, 8, 12, 32


class WatchedBatch:
    """SGLang's batch, recording the module of every reader of its fields."""

    def __init__(self, batch):
        self.batch = batch
        self.readers: set[str] = set()

    def __getattr__(self, name):
        self.readers.add(sys._getframe(1).f_globals["__name__"])
        return getattr(self.batch, name)


def mha_layer() -> SglangAttention:
    q_norm, k_norm = RMSNorm(HEAD_DIM), RMSNorm(HEAD_DIM)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    qk_rope = QKRope(RotaryEmbedding(HEAD_DIM, HEAD_DIM, 256, 10000.0), q_norm, k_norm)
    spec = AttentionSpec(
        "model.layers.0.self_attn.attn", HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM,
        HEAD_DIM**-0.5, qk_rope=qk_rope,
    )  # fmt: skip
    return SglangAttention(spec)


def mla_layer() -> SglangMLAAttention:
    kv_b_proj = nn.Linear(LATENT, HEADS * (NOPE + V_DIM), bias=False)
    spec = AttentionSpec(
        "model.layers.0.self_attn.attn", HEADS, 1, NOPE + ROPE, V_DIM, (NOPE + ROPE) ** -0.5,
        kind="MLA", kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, kv_b_proj=kv_b_proj,
    )  # fmt: skip
    layer = SglangMLAAttention(spec)
    layer.impl.process_weights_after_loading()
    return layer


def step_inputs(kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t = positions.shape[0]
    if kind == "MHA":
        q, k = torch.randn(t, HEADS, HEAD_DIM), torch.randn(t, KV_HEADS, HEAD_DIM)
        return q, k, torch.randn(t, KV_HEADS, HEAD_DIM), positions
    q_nope, q_pe = torch.randn(t, HEADS, NOPE), torch.randn(t, HEADS, ROPE)
    return q_nope, q_pe, torch.randn(t, LATENT), torch.randn(t, ROPE)


def pool_for(kind: str) -> FakePool:
    if kind == "MHA":
        return FakePool(256, KV_HEADS, HEAD_DIM, HEAD_DIM, 1)
    return FakePool(256, 1, LATENT + ROPE, LATENT, 1, mla_latent=LATENT)


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_atom_layers_never_read_sglangs_batch(kind, prefix_lens, new_lens):
    torch.manual_seed(3)
    layer = mha_layer() if kind == "MHA" else mla_layer()
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    inputs = step_inputs(kind, positions)
    runs = {}
    for route in ("atom", "sglang"):
        req_to_token, plain_batch = make_batch(prefix_lens, new_lens, 1, 256)
        batch = WatchedBatch(plain_batch)
        pool = pool_for(kind)
        # ATOM's backend over the pool: under the "sglang" route it stands for any of
        # SGLang's backends, reached only through SGLang's RadixAttention.
        backend = make_backend(req_to_token, pool, 1)
        backend.init_forward_metadata(batch)
        layer.bind_kv_pool(pool, 1, 0)
        if route == "atom":
            step = set_forward_context(backend.take_step("test"))
        else:
            step = set_forward_context(None, host_attention=sglang_backend_attention(batch))
        with sglang_context(SglangContext(attn_backend=backend)), step:
            out = layer(*(x.clone() for x in inputs))
        slots = plain_batch.out_cache_loc
        cache = pool.k[slots] if kind == "MHA" else pool.kv[slots]
        runs[route] = (out.reshape(out.shape[0], -1), cache)
        assert batch.readers, "the watch saw no reader"  # the builder read it
        readers = {m for m in batch.readers if not m.startswith(BATCH_READERS)}
        assert readers == set(), f"{route} route: {sorted(readers)} read SGLang's batch"
    torch.testing.assert_close(runs["sglang"], runs["atom"], rtol=1e-4, atol=1e-4)


def test_fake_batch_has_only_sglang_forward_batch_fields():
    """The batch these tests hand SGLang's RadixAttention (backend_fakes.make_batch) has
    only fields of SGLang's ForwardBatch, with their meaning; among them
    `global_num_token_non_padded_cpu` (None: no padded tokens), which SGLang 0.5.23's
    RadixAttention reads on every extend step. A renamed field fails here."""
    import dataclasses

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    _, batch = make_batch([0, 5], [3, 1], 1, 256)
    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert set(vars(batch)) - fields == set()
    assert batch.global_num_token_non_padded_cpu is None
