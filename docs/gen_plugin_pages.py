"""Copies each plugin's README into the site as its user page (run by `nox -s docs`).

The READMEs are the pages PyPI shows; the site takes them as they are, with their links
into the repository turned into links within the site.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ("atom-vllm", "atom-sglang")
SITE_LINKS = {"](../../README.md)": "](../index.md)", "](../../docs/": "](../"}


def render(package: str) -> str:
    text = (ROOT / "packages" / package / "README.md").read_text()
    for repo_link, site_link in SITE_LINKS.items():
        text = text.replace(repo_link, site_link)
    return text


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for package in PLUGINS:
        (out / f"{package}.md").write_text(render(package))
