"""Checkpoint loading: safetensors iteration, HF-name mapping, per-parameter weight loaders."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from atom.layers.attention_spec import AttentionSpec

logger = logging.getLogger(__name__)

# (ATOM parameter fragment, checkpoint fragment, shard id)
StackedMapping = list[tuple[str, str, object]]
# (ATOM parameter fragment, checkpoint fragment, expert id, shard id)
ExpertMapping = list[tuple[str, str, int, str]]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model, naming the tensor at fault."""


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {str(folder)!r}")
    return files


def checkpoint_tensor_names(folder: str | Path) -> set[str]:
    """Every tensor name of a checkpoint, read from the file headers only."""
    names: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def iterate_safetensors(
    folder: str | Path, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(folder)
    for path in tqdm(files, desc="Loading safetensors shards", disable=not progress, unit="shard"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _call_loader(name: str, param: nn.Parameter, tensor: torch.Tensor, *args) -> None:
    loader = getattr(param, "weight_loader", None)
    try:
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}"
                )
            param.data.copy_(tensor)
        else:
            loader(param, tensor, *args)
    except (ValueError, RuntimeError, KeyError, IndexError) as exc:
        raise CheckpointError(f"cannot load checkpoint tensor {name!r}: {exc}") from exc


def load_with_mapping(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    experts: ExpertMapping = (),
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Routes each checkpoint tensor to its parameter; returns the loaded parameter names.

    Tensors the model has no place for (rotary inv_freq, extra MTP layers, ...) are
    skipped when `skip` says so; any other unknown name is an error.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        target = _route(name, params, stacked, experts)
        if target is None:
            raise CheckpointError(f"checkpoint tensor {name!r} has no matching model parameter")
        param_name, args = target
        _call_loader(name, params[param_name], tensor, *args)
        loaded.add(param_name)
    return loaded


def _route(name, params, stacked, experts):
    for param_part, ckpt_part, expert_id, shard_id in experts:
        if ckpt_part in name:
            candidate = name.replace(ckpt_part, param_part)
            if candidate in params:
                return candidate, (name, shard_id, expert_id)
    for param_part, ckpt_part, shard_id in stacked:
        if ckpt_part in name:
            candidate = name.replace(ckpt_part, param_part)
            if candidate in params:
                return candidate, (shard_id,)
    if name in params:
        return name, ()
    return None


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def process_weights_after_loading(model: nn.Module, skip: Iterable[nn.Module] = ()) -> None:
    """Runs each submodule's post-load hook in module order, so a layer built after the
    layers it reads (an MLA impl after its kv_b_proj) sees their final weights. Modules in
    `skip` are a host's to process."""
    skipped = {id(m) for m in skip}
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None and module is not model and id(module) not in skipped:
            hook()


# Per-tensor KV-cache scales a checkpoint may give an attention layer `<p>.attn`: vLLM's
# `<p>.attn.k_scale`, the older `<p>.k_scale`, compressed-tensors' `<p>.k_proj.output_scale`.
KV_SCALE_SUFFIXES = (
    (".k_scale", "k_scale"),
    (".v_scale", "v_scale"),
    (".k_proj.output_scale", "k_scale"),
    (".v_proj.output_scale", "v_scale"),
)


def take_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Sets the KV-cache scales of the model's attention impls from the checkpoint tensors
    that carry them; yields every other tensor.

    An impl takes scales when it has `k_scale` / `v_scale` attributes next to its
    `spec`: ATOM's native impl, and the plugins' layers, whose setters hand the values
    to the host's attention layer."""
    layers = {
        m.spec.layer_name: m
        for m in model.modules()
        if isinstance(getattr(m, "spec", None), AttentionSpec) and hasattr(m, "k_scale")
    }
    scaled: set[str] = set()
    for name, tensor in weights:
        target = _kv_scale_target(name, layers)
        if target is None:
            yield name, tensor
            continue
        layer, attribute = target
        if tensor.numel() != 1:
            raise CheckpointError(
                f"{name!r} has shape {tuple(tensor.shape)}: only per-tensor KV-cache scales "
                "(one value) are supported"
            )
        setattr(layer, attribute, float(tensor))
        scaled.add(layer.spec.layer_name)
    if scaled:
        logger.info(
            "KV-cache scales from the checkpoint for %d of %d layers", len(scaled), len(layers)
        )


def _kv_scale_target(name: str, layers: dict[str, nn.Module]) -> tuple[nn.Module, str] | None:
    for suffix, attribute in KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            owner = name[: -len(suffix)]
            for layer_name in (owner, f"{owner}.attn"):
                if layer_name in layers:
                    return layers[layer_name], attribute
    return None


def load_model_weights(model: nn.Module, folder: str | Path, progress: bool = True) -> None:
    """Loads a HF safetensors checkpoint (single file or sharded) into an ATOM model."""
    loaded = model.load_weights(take_kv_scales(model, iterate_safetensors(folder, progress)))
    check_all_loaded(model, loaded)
    process_weights_after_loading(model)
