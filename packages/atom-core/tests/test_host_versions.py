"""atom.hosts.plugin's version guard: the tested range, the log line, the explicit request."""

from __future__ import annotations

import logging

import pytest

from atom.hosts.plugin import HostRange, UnsupportedHostVersion, check_host_version, release

VLLM = HostRange("vLLM", "0.32", "0.33")


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("0.32.0", (0, 32, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.5.21.post1", (0, 5, 21)),
     ("0.33.0rc1", (0, 33, 0)), ("0.32.1.dev3+g1234", (0, 32, 1))],
)  # fmt: skip
def test_release_reads_the_numeric_part(version, parsed):
    assert release(version) == parsed


@pytest.mark.parametrize(
    ("version", "admitted"),
    [("0.32.0", True), ("0.32.0+cpu", True), ("0.32.9", True), ("0.31.9", False),
     ("0.33.0", False), ("0.33.0rc1", False), ("1.0.0", False)],
)  # fmt: skip
def test_range_admits_the_tested_minor_only(version, admitted):
    assert VLLM.admits(version) is admitted


def test_outside_the_range_logs_one_line_and_declines():
    said = []
    ok = check_host_version(VLLM, "0.27.0", False, lambda *a, **k: said.append((a, k)))
    assert ok is False
    ((args, kwargs),) = said
    line = args[0] % args[1:]
    assert line == (
        "vLLM 0.27.0 is outside the range atom-vllm was tested on (vLLM >=0.32,<0.33): "
        "ATOM inactive, the host runs its own models"
    )
    assert kwargs["level"] == logging.WARNING


def test_an_explicit_request_outside_the_range_is_an_error_naming_both_versions():
    with pytest.raises(UnsupportedHostVersion) as error:
        check_host_version(VLLM, "0.34.1", True, lambda *a, **k: pytest.fail("logged"))
    assert "vLLM 0.34.1" in str(error.value) and "vllm>=0.32,<0.33" in str(error.value)


def test_inside_the_range_says_nothing():
    assert check_host_version(VLLM, "0.32.0", True, lambda *a, **k: pytest.fail("logged"))


def test_the_newest_host_check_runs_outside_the_range_after_one_line(monkeypatch):
    monkeypatch.setenv("ATOM_TRY_UNTESTED_HOST", "1")
    said = []
    assert check_host_version(VLLM, "0.34.1", True, lambda *a, **k: said.append((a, k)))
    ((args, kwargs),) = said
    assert args[0] % args[1:] == (
        "vLLM 0.34.1 is outside the range atom-vllm was tested on (vLLM >=0.32,<0.33): "
        "ATOM runs on it (ATOM_TRY_UNTESTED_HOST=1)"
    )
    assert kwargs["level"] == logging.WARNING
