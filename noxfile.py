"""Sessions for the whole monorepo: lint, tests, build, docs, demo (and the slow host suites)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
CORE = ROOT / "packages" / "atom-core"
TORCH = "torch==2.13.0"  # the CPU wheel on this machine; CI may add the PyTorch CPU index
TRANSFORMERS = "transformers==5.12.1"

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def install_core(session: nox.Session, *extras: str) -> None:
    # torch first, so nothing resolves a CUDA build of it from PyPI.
    session.install(TORCH, TRANSFORMERS)
    spec = f"{CORE}[{','.join(extras)}]" if extras else str(CORE)
    session.install("-e", spec)


def read_project(package: Path) -> dict:
    return tomllib.loads((package / "pyproject.toml").read_text())["project"]


def core_pin_mismatches(packages: list[Path]) -> list[str]:
    """Plugins must pin atom-core to exactly atom-core's own version."""
    projects = {read_project(p)["name"]: read_project(p) for p in packages}
    core_version = projects["atom-core"]["version"]
    problems = []
    for name, project in projects.items():
        for requirement in project.get("dependencies", []):
            if requirement.replace(" ", "").startswith("atom-core"):
                wanted = f"atom-core=={core_version}"
                if requirement.replace(" ", "") != wanted:
                    problems.append(f"{name} depends on {requirement!r}; expected {wanted!r}")
    return problems


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The CPU test suite of atom-core (host plugins have their own sessions)."""
    install_core(session, "server", "test")
    session.run("pytest", str(CORE / "tests"), "-q", *session.posargs, env={"PYTHONHASHSEED": "0"})


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    problems = core_pin_mismatches(PACKAGES)
    if problems:
        session.error("; ".join(problems))
    session.install("build", "twine")
    dist = ROOT / "dist"
    for package in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), str(package))
    session.run("twine", "check", "--strict", *map(str, sorted(dist.glob("*"))))


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    install_core(session)
    session.install("mkdocs")
    session.run("python", "docs/gen_models.py", "docs/models.md")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    install_core(session, "server")
    session.run("atom", "demo", *session.posargs)
