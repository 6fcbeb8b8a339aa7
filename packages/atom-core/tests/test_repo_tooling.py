"""The monorepo's own tooling: the atom-core pin check, the docs generated from the code
(docs/models.md and the README's "What runs where", written by docs/gen_models.py) and the
code's pointers into docs/performance.md."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

from atom.registry import all_models

ROOT = Path(__file__).resolve().parents[3]


def load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


core_pin_mismatches = load("tools/check_pins.py").core_pin_mismatches


def write_project(packages: Path, name: str, version: str, dependencies=()) -> None:
    folder = packages / name
    folder.mkdir(parents=True)
    deps = ", ".join(f'"{d}"' for d in dependencies)
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "{version}"\ndependencies = [{deps}]\n'
    )


@pytest.mark.parametrize("pin", ["atom-core==0.2.0", "atom-core == 0.2.0", "atom_core==0.2.0"])
def test_matching_pin_passes(tmp_path, pin):
    write_project(tmp_path, "atom-core", "0.2.0", ["torch"])
    write_project(tmp_path, "atom-vllm", "0.2.0", [pin, "vllm"])
    assert core_pin_mismatches(tmp_path) == []


@pytest.mark.parametrize("pin", ["atom-core==0.1.0", "atom-core>=0.2.0", "atom-core", None])
def test_wrong_or_missing_pin_fails(tmp_path, pin):
    write_project(tmp_path, "atom-core", "0.2.0")
    write_project(tmp_path, "atom-sglang", "0.2.0", [pin] if pin else ["sglang"])
    (problem,) = core_pin_mismatches(tmp_path)
    assert "atom-sglang" in problem and "atom-core==0.2.0" in problem


def test_repository_pins_agree():
    assert core_pin_mismatches(ROOT / "packages") == []


def test_models_page_lists_every_registered_architecture():
    page = load("docs/gen_models.py").render()
    for entry in all_models():
        assert f"`{entry.architecture}`" in page


def test_readme_hosts_table_names_every_host_of_every_architecture():
    table = load("docs/gen_models.py").render_hosts().splitlines()
    for entry in all_models():
        (row,) = [line for line in table if f"`{entry.architecture}`" in line]
        assert row.count("| yes ") == len(entry.hosts), row


def test_checked_in_docs_are_what_the_registry_generates():
    """Run `python docs/gen_models.py` after changing atom.registry."""
    generator = load("docs/gen_models.py")
    assert (ROOT / "docs" / "models.md").read_text() == generator.render()
    readme = (ROOT / "README.md").read_text()
    assert readme == generator.readme_with_hosts(readme)


def test_readme_layout_names_every_atom_subpackage():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    atom_dir = ROOT / "packages" / "atom-core" / "src" / "atom"
    for folder in sorted(d.name for d in atom_dir.iterdir() if d.is_dir()):
        if not folder.startswith("__"):
            assert f" {folder}/ " in layout, folder


def noxfile_versions(name: str) -> list:
    """The versions noxfile.py's constant `name` lists (or keys), sorted."""
    from packaging.version import Version

    nox_module = ast.parse((ROOT / "noxfile.py").read_text())
    (tested,) = [
        ast.literal_eval(node.value)
        for node in nox_module.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]
    ]
    return sorted(map(Version, tested))


def declared_specifier(package: Path, dependency: str):
    """The version specifier `package`'s pyproject declares for `dependency`."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    (spec,) = [
        Requirement(d).specifier
        for d in project["dependencies"]
        if Requirement(d).name == dependency
    ]
    return spec


def test_declared_transformers_range_is_tested_at_both_ends():
    """atom-core's transformers range starts at the lowest version `nox -s tests` runs and
    stops before the minor after the highest one, so no untested release is allowed."""
    tested = noxfile_versions("TRANSFORMERS_TESTED")
    spec = declared_specifier(ROOT / "packages" / "atom-core", "transformers")
    low, high = tested[0], tested[-1]
    assert {(s.operator, s.version) for s in spec} == {
        (">=", str(low)),
        ("<", f"{high.major}.{high.minor + 1}"),
    }


def test_declared_sglang_range_is_tested_at_both_ends():
    """atom-sglang's SGLang range (its pyproject, the `SUPPORTED` range its register() checks,
    the version rows of both READMEs) starts at the lowest SGLang `nox -s tests_sglang`
    runs and stops right after the highest one, so no untested release above it is
    allowed; the READMEs name every tested version."""
    tested = noxfile_versions("SGLANG_TESTED")
    low, high = tested[0], tested[-1]
    stop = f"{high.major}.{high.minor}.{high.micro + 1}"
    plugin = ROOT / "packages" / "atom-sglang"
    spec = declared_specifier(plugin, "sglang")
    assert {(s.operator, s.version) for s in spec} == {(">=", str(low)), ("<", stop)}
    source = (plugin / "src" / "atom_sglang" / "__init__.py").read_text()
    assert f'SUPPORTED = HostRange("SGLang", "{low}", "{stop}")' in source
    declared = f"`>={low},<{stop}`"
    for readme in (ROOT / "README.md", plugin / "README.md"):
        rows = readme.read_text().splitlines()
        (row,) = [r for r in rows if r.startswith(("| `atom-sglang` | SGLang |", "| SGLang | `"))]
        assert declared in row, (readme, row)
        assert all(str(v) in row.replace(declared, "") for v in tested), (readme, row)


def test_every_package_declares_the_same_python():
    import tomllib

    declared = {
        path.parent.name: tomllib.loads(path.read_text())["project"]["requires-python"]
        for path in sorted((ROOT / "packages").glob("*/pyproject.toml"))
    }
    assert len(declared) == 3 and len(set(declared.values())) == 1, declared


# `docs/performance.md, "Section"`, also broken over comment or docstring lines.
PERFORMANCE_POINTER = re.compile(r'docs/performance\.md, "([^"]+)"')


# A measured figure (a time, a rate) or a date: what docs/performance.md holds, not code.
BENCHMARK_FIGURE = re.compile(r"\d ?(ms|us|µs|TFLOP/s|GB/s|TB/s|tok/s)\b|\b20\d\d-\d\d-\d\d\b")
CODE_FOLDERS = ("packages/atom-core/src", "benchmarks", "tools")


def comments_and_docstrings(source: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    texts = [token.string for token in tokens if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            texts.append(ast.get_docstring(node, clean=False) or "")
    return texts


def code_files() -> list[Path]:
    return sorted(path for folder in CODE_FOLDERS for path in (ROOT / folder).rglob("*.py"))


def test_code_comments_point_to_benchmark_figures_instead_of_holding_them():
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)!r}"
        for path in code_files()
        for text in comments_and_docstrings(path.read_text())
        for match in BENCHMARK_FIGURE.finditer(text)
    ]
    assert not found, found


def test_pointers_into_performance_page_name_its_sections():
    headings = {
        line.lstrip("#").strip()
        for line in (ROOT / "docs" / "performance.md").read_text().splitlines()
        if line.startswith("#")
    }
    pointers = []
    for path in code_files():
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())
        pointers += [(path.name, section) for section in PERFORMANCE_POINTER.findall(text)]
    assert pointers
    missing = [f"{name}: {section}" for name, section in pointers if section not in headings]
    assert not missing, missing
