"""The README shows the difference between the plain and the guarded GPT example: it must be the real one."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAIN, GUARDED = ROOT / "examples" / "gpt_ddp_plain.py", ROOT / "examples" / "gpt_ddp_guarded.py"


def _changed(lines: list[str]) -> set[str]:
    return {line for line in lines if line[:1] in ("+", "-") and not line.startswith(("+++", "---"))}


def _readme_diff() -> list[str]:
    section = (ROOT / "README.md").read_text().split("### Adopting it in the loop you already have", 1)[1]
    match = re.search(r"```diff\n(.*?)```", section, re.S)
    assert match, "the adoption section shows a diff"
    return match.group(1).splitlines()


def _real_diff() -> list[str]:
    plain, guarded = PLAIN.read_text().splitlines(), GUARDED.read_text().splitlines()
    return list(difflib.unified_diff(plain, guarded, lineterm="", n=0))


def test_every_line_the_readme_shows_changed_is_a_changed_line() -> None:
    real = _real_diff()
    shown = _changed(_readme_diff())
    assert shown, "the README's diff shows changed lines"
    assert shown <= _changed(real)


def test_the_readme_leaves_out_only_the_docstrings_imports_and_arguments() -> None:
    real = _real_diff()
    guarded = GUARDED.read_text().splitlines()
    plain = PLAIN.read_text().splitlines()
    header_lines = set()
    for source, sign in ((plain, "-"), (guarded, "+")):
        # The docstring and the imports: everything before the first definition.
        end = min(i for i, line in enumerate(source) if line.startswith("def "))
        header_lines |= {sign + line for line in source[:end]}
    left_out = _changed(real) - _changed(_readme_diff())
    assert all(line in header_lines or "add_argument(" in line for line in left_out), sorted(left_out)


def test_a_readme_line_that_is_not_in_the_files_is_caught() -> None:
    real = _real_diff()
    assert not {"+        result = guard.step(step, fast=True)"} <= _changed(real)
