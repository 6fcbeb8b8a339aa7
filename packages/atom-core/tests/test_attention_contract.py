"""The impl contract (atom.layers.attention_impl): ATOM's own impls satisfy the declared
protocols, hold the layer's spec itself, and whether q/k rope is fused is decided in one
place (the plugins' impls are checked against the same protocols in their own suites)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from atom.kernels import paged_attention
from atom.layers.attention import Attention
from atom.layers.attention_impl import AttentionImpl, MLAImpl, PagedCacheOwner, SparseMLAImpl
from atom.layers.attention_spec import AttentionSpec
from atom.layers.compressed_attention_impl import CompressedAttentionImpl
from atom.layers.mla_impl import NativeMLAImpl
from atom.layers.paged_attention_impl import NativeAttentionImpl, write_kv_and_attend
from atom.testing.contract import contract_problems

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [
    ROOT / "packages" / "atom-core" / "src" / "atom",
    ROOT / "packages" / "atom-vllm" / "src" / "atom_vllm",
    ROOT / "packages" / "atom-sglang" / "src" / "atom_sglang",
]


@pytest.mark.parametrize(
    ("cls", "protocols"),
    [
        (NativeAttentionImpl, (AttentionImpl, PagedCacheOwner)),
        (NativeMLAImpl, (MLAImpl, SparseMLAImpl, PagedCacheOwner)),
        (CompressedAttentionImpl, (PagedCacheOwner,)),
    ],
)
def test_native_impls_satisfy_the_protocols(cls, protocols):
    for protocol in protocols:
        assert contract_problems(cls, protocol) == []


def test_contract_problems_names_a_different_signature():
    class Stale(nn.Module):
        spec = None

        def forward(self, q, k, v):  # positions missing
            return q

    (problem,) = contract_problems(Stale, AttentionImpl)
    assert "positions" in problem


def test_the_impl_holds_the_layers_spec():
    """A reference, not a copy: what the model loads into the spec later reaches it."""
    layer = Attention(4, 16, 0.25, 2, "model.layers.0.self_attn.attn", sliding_window=8)
    assert isinstance(layer.impl, AttentionImpl)
    assert layer.impl.spec is layer.spec


def test_mla_impl_is_an_mla_impl():
    spec = AttentionSpec(
        layer_name="attn", num_heads=2, num_kv_heads=1, head_dim=24, v_head_dim=12, scale=1.0,
        kind="MLA", kv_lora_rank=32, qk_rope_head_dim=8,
        kv_b_proj=nn.Linear(32, 2 * (16 + 12), bias=False),
    )  # fmt: skip
    impl = NativeMLAImpl(spec)
    assert isinstance(impl, MLAImpl) and isinstance(impl, PagedCacheOwner)
    impl.bind_kv_cache((torch.zeros(1, 4, 40),), kv_group=0)


def _python_files():
    for source in SOURCES:
        yield from sorted(source.rglob("*.py"))


def test_no_impl_declares_whether_it_fuses_rope():
    """Rope fusion is decided by `write_kv_and_attend` from the spec, nowhere else: no
    `fuses_qk_rope` flag for layers to ask impls about."""
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "attr", None) or getattr(node, "id", None)
            if name == "fuses_qk_rope" or getattr(node, "value", None) == "fuses_qk_rope":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize(
    ("step", "most"),
    # q, k, v, cache, metadata, spec, positions, out / query, cache, metadata, scoring,
    # out, new_kv: the layer's cache, the step and the spec travel as one object each.
    [(write_kv_and_attend, 8), (paged_attention, 6)],
)
def test_the_attention_steps_take_the_step_as_objects(step, most):
    assert len(inspect.signature(step).parameters) <= most
