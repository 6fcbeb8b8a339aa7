"""Writes the supported-models table from atom.registry (run by `nox -s docs`)."""

from __future__ import annotations

import sys
from pathlib import Path

from atom.registry import all_models


def render() -> str:
    lines = [
        "# Supported models",
        "",
        "Generated from `atom.registry`.",
        "",
        "| architecture | family | attention | MoE | quantization | hosts |",
        "|---|---|---|---|---|---|",
    ]
    for entry in all_models():
        lines.append(
            f"| `{entry.architecture}` | {entry.family} | {entry.attention} | "
            f"{'yes' if entry.moe else 'no'} | {', '.join(entry.quant)} | {', '.join(entry.hosts)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(render())
