"""The adoption page shows the difference between the plain and the guarded GPT example: the real one.

``docs/hooks.py`` computes the diff from the two files, and the page holds
what it computed between ``<!-- generated: gpt-example-diff -->`` markers (so it
reads whole on the repository page; ``python docs/hooks.py`` rewrites it).
These tests hold the generator to the files: every line it shows changed is a
changed line, it leaves out only the docstring, imports the guarded file no
longer needs and help texts, and a change anywhere else is shown; and the
page's copy is the generator's output.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import shutil
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
PLAIN, GUARDED = ROOT / "examples" / "gpt_ddp_plain.py", ROOT / "examples" / "gpt_ddp_guarded.py"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sdcguard_docs_hooks_diff", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _changed(lines: list[str]) -> set[str]:
    return {line for line in lines if line[:1] in ("+", "-") and not line.startswith(("+++", "---"))}


def _shown(root: Path = ROOT) -> list[str]:
    match = re.search(r"```diff\n(.*?)```", _hooks().gpt_example_diff(root), re.S)
    assert match, "the generator returns a diff block"
    return match.group(1).splitlines()


def _real_diff(plain: Path = PLAIN, guarded: Path = GUARDED) -> list[str]:
    return list(difflib.unified_diff(plain.read_text().splitlines(), guarded.read_text().splitlines(),
                                     lineterm="", n=0))


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "examples").mkdir()
    for path in (PLAIN, GUARDED):
        shutil.copy(path, tmp_path / "examples" / path.name)
    return tmp_path / "examples" / GUARDED.name


def _committed_diff(page: str) -> str:
    match = re.search(r"^<!-- generated: gpt-example-diff -->\n\n(.*?)\n\n<!-- end generated: gpt-example-diff -->$",
                      page, re.S | re.M)
    assert match, "the adoption page holds the generated diff between its markers"
    return match.group(1)


def test_the_adoption_page_holds_the_generated_diff_and_no_other() -> None:
    page = (ROOT / "docs" / "adopting.md").read_text()
    assert _committed_diff(page) == _hooks().gpt_example_diff(ROOT).rstrip("\n")
    assert page.count("```diff") == 1


def test_a_changed_example_makes_the_committed_diff_stale(tmp_path: Path) -> None:
    guarded = _copy(tmp_path)
    guarded.write_text(guarded.read_text().replace("import math\n", "import json\nimport math\n", 1))
    page = (ROOT / "docs" / "adopting.md").read_text()
    assert _committed_diff(page) != _hooks().gpt_example_diff(tmp_path).rstrip("\n")


def test_every_line_shown_changed_is_a_changed_line() -> None:
    shown = _changed(_shown())
    assert shown, "the diff shows changed lines"
    assert shown <= _changed(_real_diff())
    for line in ("+from sdcguard.agent import GuardConfig, SDCGuard", "+        result = guard.step(step)",
                 "+            guard.save_checkpoint(step + 1)", "-        scheduler.step()"):
        assert line in shown


def test_only_the_docstrings_imports_and_help_texts_are_left_out() -> None:
    plain, guarded = PLAIN.read_text().splitlines(), GUARDED.read_text().splitlines()
    header = set()
    for source, sign in ((plain, "-"), (guarded, "+")):
        end = min(i for i, line in enumerate(source) if line.startswith("def "))
        header |= {sign + line for line in source[:end]}
    left_out = _changed(_real_diff()) - _changed(_shown())
    assert left_out, "the docstrings differ, so something is left out"
    assert all(line in header or "add_argument(" in line for line in left_out), sorted(left_out)
    assert "+from sdcguard.agent import GuardConfig, SDCGuard" not in left_out


def test_a_new_import_in_the_guarded_file_is_shown(tmp_path: Path) -> None:
    guarded = _copy(tmp_path)
    guarded.write_text(guarded.read_text().replace("import math\n", "import json\nimport math\n", 1))
    assert "+import json" in _changed(_shown(tmp_path))


def test_an_argument_changed_beyond_its_help_text_is_shown(tmp_path: Path) -> None:
    guarded = _copy(tmp_path)
    text = guarded.read_text()
    changed = text.replace('p.add_argument("--checkpoint-every", type=int, default=500)',
                           'p.add_argument("--checkpoint-every", type=int, default=50)', 1)
    assert changed != text
    guarded.write_text(changed)
    assert '+    p.add_argument("--checkpoint-every", type=int, default=50)' in _changed(_shown(tmp_path))


def test_a_line_that_is_not_in_the_files_is_caught() -> None:
    assert not {"+        result = guard.step(step, fast=True)"} <= _changed(_real_diff())
