"""The Lambda package holds the handlers, their logic, the contract and lineage: nothing else."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest

from sdcguard.infra.deploy import package

ALLOWED = ("sdcguard/lambdas/", "sdcguard/contract/", "sdcguard/lineage/", "sdcguard/__init__.py",
           "sdcguard/__pycache__/__init__.")
# sdcguard's parts that never go in (its CLI and the rest), and the tree's other packages.
NEVER = ("cli", "commands", "errors", "__main__", "infra", "agent", "campaign")
NEVER_TOP = ("tests", "benchmarks", "agent", "contract", "lineage", "lambdas", "infra", "campaign")


@pytest.fixture(scope="module")
def names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The project's own entries of a package built as deploy builds it (no third-party dependencies)."""
    work = tmp_path_factory.mktemp("package")
    (work / "deps").mkdir()
    zip_path = work / "lambda.zip"
    package.write_zip(zip_path, work / "deps", compile_sources=True)
    with zipfile.ZipFile(zip_path) as archive:
        return archive.namelist()


def test_the_package_holds_only_the_pipelines_packages(names: list[str]) -> None:
    assert package.SOURCES == ("lambdas", "contract", "lineage")
    outside = [n for n in names if not n.startswith(ALLOWED)]
    assert outside == []
    assert "sdcguard/lambdas/handlers/decide.py" in names
    assert "sdcguard/contract/schemas/alarm.schema.json" in names
    assert "sdcguard/lineage/pointer.py" in names
    assert "sdcguard/__init__.py" in names


def test_the_package_has_no_command_line(names: list[str]) -> None:
    clis = [n for n in names if Path(n).stem.split(".")[0] in ("cli", "ops_cli", "__main__") or "_cli" in n]
    assert clis == []


def test_nothing_in_the_package_imports_what_is_not_in_it(names: list[str]) -> None:
    root = Path(package.ROOT)
    upward: list[str] = []
    for name in names:
        if not name.endswith(".py"):
            continue
        tree = ast.parse((root / name).read_text(), name)
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            upward += [f"{name}: {m}" for m in modules if _outside(m)]
    assert upward == []


def _outside(module: str) -> bool:
    """A module the package does not hold: sdcguard's CLI or another part, or an old or other top-level name."""
    parts = module.split(".")
    return parts[0] in NEVER_TOP or (parts[0] == "sdcguard" and (len(parts) == 1 or parts[1] in NEVER))


def test_an_import_of_what_is_left_out_is_caught() -> None:
    assert _outside("sdcguard.cli")
    assert _outside("sdcguard.agent.guard")
    assert _outside("agent.guard")  # old name on purpose
    assert not _outside("sdcguard.lineage.pointer")
    assert not _outside("boto3")


def test_a_package_with_more_in_it_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above are able to fail: a package that also took the CLI is refused by them."""
    monkeypatch.setattr(package, "SOURCES", (*package.SOURCES, "sdcguard"))
    (tmp_path / "deps").mkdir()
    package.write_zip(tmp_path / "more.zip", tmp_path / "deps", compile_sources=False)
    with zipfile.ZipFile(tmp_path / "more.zip") as archive:
        outside = [n for n in archive.namelist() if not n.startswith(ALLOWED)]
    assert "sdcguard/commands/incidents.py" in outside
    assert "sdcguard/cli.py" in outside
