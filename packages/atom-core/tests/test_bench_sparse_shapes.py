"""The bench shapes of issue #34's families (DeepSeek-V3.2, GLM-5, Kimi-K2.5's text
model, DeepSeek-V4-Flash) at the depth their declarations give for one H100: each builds ATOM's model (on
the meta device: no memory, no weights) and its bf16 weights leave an H100 room for the
KV cache, the activations of a 32k-token prefill and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from atom.bench.shapes import parse_shapes
from atom.layers.compressed_attention import CompressedAttention
from atom.layers.dsa_attention import SparseLatentAttention
from atom.registry import get_entry

H100_BYTES = 80e9
WEIGHT_BUDGET = 0.7 * H100_BYTES
# -> the index_topk of their DeepSeek Sparse Attention layers
ONE_H100 = {
    "deepseek-v3.2:5": 2048,
    "glm-5:5": 2048,
    "kimi-k2.5:2": None,
    "deepseek-v4-flash:4": None,
}


def build_on_meta(shape):
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, shape.config_class)
    config = config_class(**shape.fields, architectures=[shape.architecture])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what the bench loads on a GPU
    try:
        with torch.device("meta"):
            return get_entry(shape.architecture).load_class()(config, None)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", list(ONE_H100))
def test_shape_builds_and_fits_one_h100(name):
    (shape,) = parse_shapes(name)
    model = build_on_meta(shape)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights < WEIGHT_BUDGET, f"{name}: {weights / 1e9:.1f} GB of weights"
    sparse = [m for m in model.modules() if isinstance(m, SparseLatentAttention)]
    topk = ONE_H100[name]
    assert len(sparse) == (shape.num_layers if topk else 0)
    assert all(m.attn.spec.index_topk == topk for m in sparse)
    compressed = [m for m in model.modules() if isinstance(m, CompressedAttention)]
    assert len(compressed) == (shape.num_layers if name.startswith("deepseek-v4") else 0)
