"""Writes a random-weight checkpoint of a shape: `python -m atom.bench.checkpoint JOB.json`.

Runs in its own process: vLLM hangs when its parent did CPU torch work before forking, and
the bench's parent stays free of torch. Weights are made on the GPU when there is one
(seconds for an 8B model) directly in bfloat16, then saved as safetensors; the folder
appears only when complete, so an interrupted write is never taken for a cached one.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from atom.bench.quantize import quantize_checkpoint


def random_model(config_class: str, architecture: str, fields: dict, device: str):
    """The shape's HF model with HF's own initialisation from seed 0, made in bfloat16 on
    `device` (fp32 first would not fit for large shapes): the weights every bench engine
    loads."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**fields, architectures=[architecture])
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def write_checkpoint(
    config_class: str, architecture: str, fields: dict, folder: Path, quantization: str | None
) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(config_class, architecture, fields, device)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    keep_given_fields(partial / "config.json", fields)
    if quantization:
        del model  # the GPU memory goes to quantizing the shards
        quantize_checkpoint(partial, quantization)
    partial.rename(folder)


def keep_given_fields(config_json: Path, fields: dict) -> None:
    """Writes back every field of the shape that the config class dropped when it derived
    others from it (Qwen3-Next's full_attention_interval becomes layer_types, but SGLang
    reads the interval)."""
    config = json.loads(config_json.read_text())
    dropped = {key: value for key, value in fields.items() if key not in config}
    if dropped:
        config_json.write_text(json.dumps(config | dropped, indent=2, sort_keys=True))


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    write_checkpoint(
        job["config_class"],
        job["architecture"],
        job["fields"],
        Path(job["folder"]),
        job.get("quantization"),
    )


if __name__ == "__main__":
    main()
