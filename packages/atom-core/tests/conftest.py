import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run on the lent GPU machine)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def hf_v2_group_limited_greedy(monkeypatch):
    """HF 5.12's DeepSeek-V2 group_limited_greedy reads a `num_experts` it never sets: the
    HF references of V2 checkpoints with that routing need it."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    monkeypatch.setattr(
        DeepseekV2Moe,
        "num_experts",
        property(lambda moe: moe.config.n_routed_experts),
        raising=False,
    )
