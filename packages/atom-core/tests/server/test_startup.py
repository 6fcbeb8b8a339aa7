"""`atom serve` that cannot start says why in one line and exits non-zero, with no
traceback; a busy port is found before the model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from atom.cli import build_parser
from tests.server.server_process import free_port

SERVE = [sys.executable, "-m", "atom.cli", "serve"]


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_startup_errors_are_one_line(checkpoint, busy_port, tmp_path):
    # Each case its own free port: the server binds it before anything else can fail.
    cases = {
        "bad model path": (
            [str(tmp_path / "missing"), "--port", str(free_port())],
            "atom serve: error: cannot load the model",
            "is not a directory",
        ),
        "bad option value": (
            [str(checkpoint), "--dtype", "float7", "--port", str(free_port())],
            "unsupported dtype",
            "",
        ),
        "missing chat template": (
            [
                str(checkpoint),
                "--chat-template",
                str(tmp_path / "none.jinja"),
                "--port",
                str(free_port()),
            ],
            "is neither a file nor a template",
            "",
        ),
        # The model path is bad too: the port is what the server checks first.
        "busy port": (
            [str(tmp_path / "missing"), "--port", str(busy_port)],
            f"atom serve: error: cannot listen on 127.0.0.1:{busy_port}",
            "Address already in use",
        ),
    }
    runs = {
        case: subprocess.Popen([*SERVE, *args], stderr=subprocess.PIPE, text=True)
        for case, (args, _, _) in cases.items()
    }
    for case, run in runs.items():
        _, stderr = run.communicate(timeout=120)
        _, *words = cases[case]
        assert run.returncode == 1, (case, stderr)
        assert "Traceback" not in stderr, (case, stderr)
        last_line = stderr.strip().splitlines()[-1]
        assert all(w in last_line for w in words), (case, stderr)


def test_bad_option_is_an_argparse_error():
    run = subprocess.run(
        [*SERVE, "model", "--max-n", "lots"], stderr=subprocess.PIPE, text=True, timeout=120
    )
    assert run.returncode == 2
    assert (
        run.stderr.strip().splitlines()[-1].endswith("argument --max-n: invalid int value: 'lots'")
    )


def test_help_groups_and_documents_every_option():
    (commands,) = [a for a in build_parser()._actions if a.dest == "command"]
    serve = commands.choices["serve"]
    groups = {group.title: group._group_actions for group in serve._action_groups}
    assert {"engine", "HTTP", "API", "limits (a request over one gets a 4xx)"} <= groups.keys()
    assert {"--api-key", "--max-n", "--max-request-body-bytes", "--chat-template"} <= {
        option for action in serve._actions for option in action.option_strings
    }
    assert all(action.help for action in serve._actions)
