# namespace: old names on purpose (this module finds them)
"""One name per module: the tree's packages are imported as ``sdcguard.<part>`` only.

The parts keep their folders at the repository's root (agent/, lambdas/, ...),
so from a checkout ``import agent`` would also work, and load a second copy of
every module under another name (two ``GuardConfig`` classes, two registries,
a mock.patch that misses). The suite refuses the old names (:func:`refuse_old_names`,
installed by ``tests/conftest.py``), and :func:`old_names_in` finds them in
the tree's text.
"""

from __future__ import annotations

import importlib.abc
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
KEEP_FILE = "namespace: old names on purpose"
"""A file that holds this is not checked (nor rewritten by the migration)."""
KEEP_LINE = "old name on purpose"
"""Nor is a line that holds this."""
NAMESPACE = "sdcguard"
OLD = ("agent", "contract", "lineage", "lambdas", "infra", "campaign")


class OldNameImported(ImportError):
    """A module of the tree was imported under its old top-level name."""


class _RefuseOldNames(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname.split(".")[0] in OLD:
            raise OldNameImported(f"import {NAMESPACE}.{fullname}, not {fullname}: one module, one name")


def refuse_old_names() -> None:
    """Make ``import agent`` (and the other old names) fail in this process."""
    if not any(isinstance(f, _RefuseOldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _RefuseOldNames())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in OLD)
    if loaded:
        raise OldNameImported(f"already imported under an old name: {', '.join(loaded)}")


def _modules(part: str) -> set[str]:
    """The first component of each dotted name below ``part``: its modules and subpackages."""
    folder = ROOT / part
    return {p.stem for p in folder.glob("*.py")} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").exists()
    }


_PARTS = "|".join(OLD)
_DOTTED = re.compile(rf"(?<![\w.\-/$@])({_PARTS})\.([A-Za-z_]\w*)")
_IMPORT = re.compile(rf"(?:^|[\s;\"'`(])(?:from\s+({_PARTS})(?:\s+|\.)import\b|import\s+({_PARTS})\b)", re.M)


def old_names_in(text: str) -> list[str]:
    """The old top-level names ``text`` imports or names (``from agent import``, ``-m agent.train``, ...)."""
    if KEEP_FILE in text:
        return []
    text = "\n".join(line for line in text.splitlines() if KEEP_LINE not in line)
    known = {part: _modules(part) for part in OLD if (ROOT / part).is_dir()}
    found = [m.group(0).strip() for m in _IMPORT.finditer(text) if not _after_from(text, m.start())]
    found += [m.group(0) for m in _DOTTED.finditer(text) if m.group(2) in known.get(m.group(1), ())]
    return found


def _after_from(text: str, start: int) -> bool:
    line = text[text.rfind("\n", 0, start) + 1 : start + 1]
    return re.search(r"\bfrom\s+[\w.]+\s+$", line) is not None
