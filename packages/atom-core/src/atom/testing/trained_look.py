"""Edits that make a random HF checkpoint look trained where HF's initialisation does not.

HF starts biases and the routing correction bias at zero and norms at one, and
DeepSeek-V4's hash-routing table (`tid2eid`) at zero (every token to expert 0): a test
on such a checkpoint would not see how those tensors are loaded and applied. Shared by
the model suites (tests/models) and the host suites (`write_host_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path


def randomize_vectors(folder: Path) -> None:
    """Moves every 1-d tensor (and stacked expert biases) of `folder`'s checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(3)
    for name, tensor in tensors.items():
        if tensor.dim() == 1 or name.endswith("_bias"):
            noise = torch.randn(tensor.shape, generator=gen) * 0.2
            tensors[name] = (tensor.float() + noise).to(tensor.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def draw_hash_tables(folder: Path, num_experts: int) -> None:
    """Gives every hash-routed layer's `tid2eid` [vocab, top_k] distinct experts per token
    (out of `num_experts`), as a released checkpoint's table does."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(4)
    for name, table in tensors.items():
        if name.endswith("tid2eid"):
            rows = [torch.randperm(num_experts, generator=gen)[: table.shape[1]] for _ in table]
            tensors[name] = torch.stack(rows).to(table.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
