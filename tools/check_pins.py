"""Every plugin under packages/ must pin atom-core to exactly atom-core's own version.

Run by `nox -s build`; exits non-zero and names each bad pin.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CORE = "atom-core"


def core_pin_mismatches(packages_dir: Path) -> list[str]:
    projects = [
        tomllib.loads(p.read_text())["project"]
        for p in sorted(Path(packages_dir).glob("*/pyproject.toml"))
    ]
    version = next(p["version"] for p in projects if p["name"] == CORE)
    wanted = f"=={version}"
    problems = []
    for project in projects:
        if project["name"] == CORE:
            continue
        pins = [
            str(r.specifier)
            for r in map(Requirement, project.get("dependencies", []))
            if canonicalize_name(r.name) == CORE
        ]
        if pins != [wanted]:
            problems.append(
                f"{project['name']} pins {CORE} as {pins or 'nothing'}; expected {CORE}{wanted}"
            )
    return problems


if __name__ == "__main__":
    problems = core_pin_mismatches(Path(__file__).resolve().parents[1] / "packages")
    print("\n".join(problems) or "atom-core pins: ok")
    sys.exit(bool(problems))
