"""Imports point down only: the layers contract of ``pyproject.toml``, checked by ``./dev check``.

The contract is run on this tree (kept) and on small package trees of the same
names with one upward import each (broken), so it is shown able to fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sdcguard.infra import check

ROOT = Path(__file__).resolve().parents[2]
# The installed package's parts (sdcguard/agent is a link to agent/, and so on), below its own CLI.
PARTS = ("infra", "campaign", "lambdas", "agent", "lineage", "contract")
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _contract_text() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("[tool.importlinter]")
    return text[start : text.index("\n[tool.", start + 1)]


def _top_modules() -> list[str]:
    """The CLI's modules the package contract's top layer names (``__main__ : cli : ...``)."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return [m.strip() for m in contract["layers"][0].replace("|", ":").split(":")]


def _agent_modules() -> list[str]:
    """The agent's modules the agent's own layers contract names."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][1]
    return [m.strip() for layer in contract["layers"] for m in layer.split("|")]


def _tree(root: Path) -> None:
    """Empty packages of the contract's names (the agent's layered modules included), as the contract sees them."""
    (root / "sdcguard").mkdir()
    (root / "sdcguard" / "__init__.py").write_text("")
    for name in PARTS:
        (root / "sdcguard" / name).mkdir()
        (root / "sdcguard" / name / "__init__.py").write_text("")
    for module in _top_modules():
        (root / "sdcguard" / f"{module}.py").write_text("")
    for module in _agent_modules():
        *packages, name = module.split(".")  # a layer may be a subpackage's module (testing.train)
        where = root / "sdcguard" / "agent"
        for package in packages:
            where = where / package
            where.mkdir(exist_ok=True)
            (where / "__init__.py").write_text("")
        (where / f"{name}.py").write_text("")
    (root / "pyproject.toml").write_text(_contract_text())


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` as ``./dev check`` runs it: in ``cwd``, with the ``pyproject.toml`` there."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_contract_is_the_agreed_layering() -> None:
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert contract["contracts"][0]["type"] == "layers"
    assert contract["root_packages"] == ["sdcguard"]
    assert contract["contracts"][0]["containers"] == ["sdcguard"]
    assert contract["contracts"][0]["layers"] == [
        "__main__ : cli : commands : errors", "infra | campaign", "lambdas | agent", "lineage", "contract"]
    assert contract["contracts"][1]["containers"] == ["sdcguard.agent"]


def test_dev_check_runs_the_contract_as_a_labelled_check() -> None:
    commands = dict(check.checks())
    assert commands["import layers"] == [str(Path(sys.executable).with_name("lint-imports"))]


def test_the_tree_keeps_the_contract() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("lineage", "sdcguard.cli"),  # what lineage/cli.py once did
        ("contract", "sdcguard.lineage"),
        ("infra", "sdcguard.cli"),
        ("lambdas", "sdcguard.agent"),  # the two middle parts are independent
        ("agent", "sdcguard.lambdas"),
        ("campaign", "sdcguard.cli"),  # the campaign is driven by the CLI, not the other way round
        ("agent", "sdcguard.campaign"),  # the agent knows nothing of the faults injected around it
        ("infra", "sdcguard.campaign"),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path: Path, importer: str, imported: str) -> None:
    # Given a tree of the same packages with the same contract
    _tree(tmp_path)
    (tmp_path / "sdcguard" / "cli.py").write_text("import sdcguard.infra\n")
    (tmp_path / "sdcguard" / "infra" / "deploy.py").write_text(
        "import sdcguard.lambdas\nimport sdcguard.agent\nimport sdcguard.contract\n")
    assert _lint(tmp_path).returncode == 0
    # When one module imports a layer above its own
    (tmp_path / "sdcguard" / importer / "upward.py").write_text(f"import {imported}\n")
    # Then the check fails and names the import
    done = _lint(tmp_path)
    assert done.returncode == 1
    assert "BROKEN" in done.stdout
    assert f"sdcguard.{importer}.upward -> {imported}" in done.stdout


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("sharded_checkpoint", "sharded"),  # the circle guard -> sharded -> sharded_checkpoint -> sharded once was
        ("sharded", "data_parallel"),  # the two parallelisms share nothing but the seam
        ("data_parallel", "guard"),  # a strategy knows nothing of the step that drives it
        ("nonfinite", "ddp_hook"),  # a verdict knows nothing of the hook that feeds it
    ],
)
def test_an_upward_import_inside_the_agent_breaks_its_contract(tmp_path: Path, importer: str, imported: str) -> None:
    # Given the agent's layered modules, with the contract
    _tree(tmp_path)
    (tmp_path / "sdcguard" / "agent" / "guard.py").write_text(
        "import sdcguard.agent.data_parallel\nimport sdcguard.agent.sharded\n")
    assert _lint(tmp_path).returncode == 0
    # When one of them imports a module of a layer above its own
    (tmp_path / "sdcguard" / "agent" / f"{importer}.py").write_text(f"import sdcguard.agent.{imported}\n")
    # Then the agent's contract fails and names the import
    done = _lint(tmp_path)
    assert done.returncode == 1
    assert "BROKEN" in done.stdout
    assert f"sdcguard.agent.{importer} -> sdcguard.agent.{imported}" in done.stdout
