"""`atom bench check` on the CPU for the host suites' family-wide checks.

Each shape starts its own host engine (20-45 s on two cores), one after another within a
command, so the shapes are dealt over a few `atom bench check` commands that run at once,
one per environment the caller gives (a host suite pins each to its own core). An engine
start keeps only part of a second core busy: two commands took the vLLM suite's check
from 466 s to 347 s here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class CheckFailed(AssertionError):
    pass


def run_check(
    shapes: list[str],
    engine: str,
    options: list[str],
    work: Path,
    envs: list[dict[str, str]],
    timeout: float = 1800,
) -> list[dict]:
    """Every row of `atom bench check --device cpu --engines engine --streams 2x40` over
    `shapes` (`options`: more of its flags), with the shapes dealt round-robin over one
    command per environment of `envs`, all at once. A command that fails raises
    CheckFailed with the tail of its output."""
    groups = [shapes[i :: len(envs)] for i in range(len(envs))]

    def check(index: int) -> list[dict]:
        out = work / f"out{index}"
        command = [sys.executable, "-m", "atom.cli", "bench", "check", "--device", "cpu"]
        command += ["--engines", engine, "--shapes", ",".join(groups[index]), "--streams", "2x40"]
        command += [*options, "--work", str(work / f"work{index}"), "--out", str(out)]
        proc = subprocess.run(
            command, env=envs[index], capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise CheckFailed(
                f"atom bench check {groups[index]} failed (rc={proc.returncode}):\n"
                + proc.stdout[-6000:]
                + proc.stderr[-3000:]
            )
        return json.loads((out / "check.json").read_text())["rows"]

    busy = [i for i, group in enumerate(groups) if group]
    with ThreadPoolExecutor(len(busy)) as pool:
        return [row for rows in pool.map(check, busy) for row in rows]
