"""`atom serve` and `atom demo` on an install without the `server` extra: one line naming
the extra, no traceback, a non-zero exit status, and no attempt to load a model first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# What a core-only install lacks: the `server` extra and what only it pulls in.
BLOCKER = textwrap.dedent(
    """
    import sys

    BLOCKED = {blocked!r}

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)


@pytest.mark.parametrize(
    ("command", "blocked"),
    [("serve", ("fastapi", "starlette", "uvicorn")), ("serve", ("uvicorn",)),
     ("serve", ("prometheus_client",)), ("demo", ("httpx",))],
)  # fmt: skip
def test_server_commands_without_server_extra_say_how_to_install_it(tmp_path, command, blocked):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(blocked)))
    missing = tmp_path / "no-such-model"  # never read: the check comes before the model
    args = [str(missing)] if command == "serve" else ["--out", str(tmp_path / "demo")]
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run(
        [sys.executable, "-m", "atom.cli", command, *args],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith(f"atom {command}: ")
    assert 'pip install "atom-core[server]"' in lines[0]
    # Names a module the blocker hid (so the blocker worked and the message is about it).
    assert any(f"({name} is missing)" in lines[0] for name in blocked), lines[0]
