# namespace: old names on purpose (the examples below)
"""One installed namespace: every module is ``sdcguard.<part>...``, under that one name only."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from setuptools import find_packages

from tests.namespace import NAMESPACE, OLD, ROOT, OldNameImported, old_names_in

# What is checked: the code, the docs, the manifests and the configs (history, CHANGELOG.md and
# docs/results/, keeps the names of its day).
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt")
SKIP = {".git", ".venv", "build", "site", "__pycache__", "results"}


def _tree_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    return [
        n
        for n in listed
        if n.endswith(SUFFIXES) or n in ("dev",)
        if not SKIP.intersection(n.split("/")[:-1]) and n != "CHANGELOG.md"
    ]


def test_the_old_names_cannot_be_imported_in_the_tests() -> None:
    with pytest.raises(OldNameImported, match=r"import sdcguard\.agent, not agent:"):
        importlib.import_module("agent.config")
    assert not [m for m in sys.modules if m.split(".")[0] in OLD]


def test_each_part_is_a_link_in_the_namespace() -> None:
    for part in OLD:
        link = ROOT / NAMESPACE / part
        assert link.is_symlink(), f"{link.relative_to(ROOT)}: expected a link to ../{part}"
        assert link.resolve() == (ROOT / part).resolve()


def test_the_package_installs_one_top_level_name() -> None:
    packages = find_packages(str(ROOT), include=["sdcguard*"])
    assert {p.split(".")[0] for p in packages} == {NAMESPACE}
    assert {f"{NAMESPACE}.{part}" for part in OLD} <= set(packages)


def test_nothing_in_the_tree_names_an_old_top_level_module() -> None:
    files = _tree_files()
    assert "agent/guard.py" in files or not (ROOT / "agent" / "guard.py").exists()
    found = [
        f"{name}: {hit}" for name in files for hit in old_names_in((ROOT / name).read_text(encoding="utf-8"))
    ]
    assert found == []


@pytest.mark.parametrize(
    "text",
    [
        "from agent import SDCGuard",
        "import agent.guard as g",
        "from lambdas.handlers import record",
        'cmd = [sys.executable, "-m", "agent.testing.train"]',
        'mock.patch("infra.deploy.deploy.ROOT")',
        "SDCGUARD_CAPSULE_FACTORY=agent.testing.train:replay_model",
        "Handler: lambdas.handlers.record.handler",
        'code = "import sys; from campaign import worker"',
    ],
)
def test_an_old_name_is_found(text: str) -> None:
    assert old_names_in(text) != []


@pytest.mark.parametrize(
    "text",
    [
        "from sdcguard.agent import SDCGuard",
        "from sdcguard.campaign import campaign as driver",
        "python -m sdcguard.agent.testing.train",
        "Handler: sdcguard.lambdas.handlers.record.handler",
        "see agent/guard.py and docs/reference/contract.md",
        "the agent.step() of a job; infra.foo is no module",
    ],
)
def test_the_new_names_and_prose_are_not_flagged(text: str) -> None:
    assert old_names_in(text) == []
