"""Test checkpoints that carry per-layer fp8 KV-cache scales."""

from __future__ import annotations

import shutil
from pathlib import Path

# Scales the tests give their checkpoints: small enough that a lost or wrong scale
# shows (K/V of std-0.1 weights divided by them stay well inside fp8's range; read back
# without them, the cache saturates or underflows).
K_SCALE, V_SCALE = 0.03, 0.02


def write_with_kv_scales(
    source: str | Path, folder: str | Path, k_scale: float = K_SCALE, v_scale: float = V_SCALE
) -> Path:
    """A copy of the single-file checkpoint `source` with KV-cache scales for layers 0 and
    1: layer 0 under vLLM's names (`self_attn.attn.k_scale`), layer 1 under
    compressed-tensors' (`self_attn.k_proj.output_scale`)."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.attn.k_scale"] = torch.tensor(k_scale)
    tensors["model.layers.0.self_attn.attn.v_scale"] = torch.tensor(v_scale)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([k_scale])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([v_scale])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
