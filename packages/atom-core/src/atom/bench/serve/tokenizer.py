"""Gives a random checkpoint a tokenizer: `python -m atom.bench.serve.tokenizer FOLDER VOCAB`.

The servers then run as they would for users, detokenizing every token, and stream one
text chunk per token (ATOM's server streams nothing but the final chunk without one).
The tokenizer is the demo's word-level one padded to the model's vocabulary, so every
prompt id is a valid token on every host. Its own process: the bench's parent stays free
of transformers and torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from atom.bench.workloads import BenchError


def ensure_tokenizer(folder: Path, vocab_size: int) -> None:
    if (folder / "tokenizer.json").exists():
        return
    proc = subprocess.run(
        [sys.executable, "-m", __name__, str(folder), str(vocab_size)],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise BenchError(f"writing a tokenizer to {folder} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    from atom.demo import build_tokenizer

    folder, vocab_size = Path(sys.argv[1]), int(sys.argv[2])
    build_tokenizer(vocab_size).save_pretrained(folder)


if __name__ == "__main__":
    main()
