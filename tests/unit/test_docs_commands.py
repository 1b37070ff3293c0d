"""The commands the pages show work as written, and print what the pages say they print.

Every ``bash``, ``console`` and ``python`` block of the pages below carries a
marker comment on the line before it, saying whether this test runs it::

    <!-- docs-test: run -->
    <!-- docs-test: not run: the reason (needs the stand-in, an account, minutes of training) -->

An unmarked block fails the test, so a command added to a page is either run
here or says why not. A marked block runs in the repository root with
``.venv``'s commands first on ``PATH``, in page order:

- ``bash``: the block as one script (``set -e``); it must exit 0.
- ``console``: each ``$ command`` line in turn; the lines under it, up to the
  next ``$``, are what it must print (stdout and stderr together); a line
  ``...`` stands for any number of lines.
- ``python``: the block as one program; it must exit 0.

A ``python`` block that is an example file verbatim (the README's snippet) is
run by ``tests/unit/test_docs.py`` and needs no marker. The CLI reference's
``--help`` blocks are compared with the real commands' output as well.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/adopting.md", "docs/deploying.md",
         "docs/standin.md", "docs/standin-kubectl.md", "docs/reference/guard-config.md"]
LANGUAGES = ("bash", "console", "python")
MARKER = re.compile(r"^<!-- docs-test: (run|not run: (?P<reason>.+\S)) -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
TIMEOUT_S = 60


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language and text, and what its marker says."""

    page: str
    line: int
    language: str
    text: str
    marker: str | None
    """"run", "not run: ...", or None when the line before the block is no marker."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str, markdown: str) -> list[Block]:
    """The page's bash, console and python blocks, each with the marker on the line before it (if any)."""
    found = []
    for match in FENCE.finditer(markdown):
        if match.group("lang") not in LANGUAGES:
            continue
        before = markdown[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.match(before)
        found.append(Block(page, markdown.count("\n", 0, match.start()) + 1, match.group("lang"),
                           match.group("body"), marker.group(1) if marker else None))
    return found


def _examples() -> set[str]:
    return {p.read_text() for p in (ROOT / "examples").glob("*.py")}


def _all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page, (ROOT / page).read_text())]


def unmarked(found: list[Block], examples: set[str]) -> list[str]:
    """Where a block says nothing of whether it is run (an example file verbatim is run elsewhere)."""
    return [b.where for b in found if b.marker is None and not (b.language == "python" and b.text in examples)]


def test_every_command_block_says_whether_it_is_run() -> None:
    assert unmarked(_all_blocks(), _examples()) == []


def test_an_unmarked_block_is_found() -> None:
    page = ("# p\n\n<!-- docs-test: run -->\n```bash\ntrue\n```\n\n```bash\nfalse\n```\n\n"
            "<!-- docs-test: not run: needs an account -->\n```console\n$ aws s3 ls\n```\n")
    found = blocks("p.md", page)
    assert [(b.line, b.marker) for b in found] == [(4, "run"), (8, None), (13, "not run: needs an account")]
    assert unmarked(found, set()) == ["p.md:8"]


# -- running them -------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDCGUARD_", "AWS_"))}
    # The commands as a user with .venv active runs them; nothing may reach an account.
    env.update({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_DEFAULT_REGION": "us-east-1",
                "COLUMNS": "98", "PYTHONPATH": str(ROOT)})
    return env


def _run(command: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, env=_env(), input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """A console block as (command, the lines it must print) pairs."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return steps


def matches(expected: list[str], printed: list[str]) -> bool:
    """Whether ``printed`` is ``expected`` line for line, a ``...`` line standing for any number of lines."""
    pattern = "\n".join(".*?" if line == "..." else re.escape(line) for line in expected)
    return re.fullmatch(pattern.replace("\n.*?\n", "(?:\n.*?)?\n"), "\n".join(printed), re.DOTALL) is not None


def test_the_output_check_takes_ellipsis_and_refuses_a_difference() -> None:
    assert matches(["Traceback (most recent call last):", "...", "ValueError: x"],
                   ["Traceback (most recent call last):", '  File "a"', "    b", "ValueError: x"])
    assert matches(["a", "...", "b"], ["a", "b"])
    assert not matches(["yes"], ["no"])
    assert not matches(["a", "b"], ["a", "b", "c"])


def _to_run() -> list[Block]:
    return [b for b in _all_blocks() if b.marker == "run"]


@pytest.mark.parametrize("block", _to_run(), ids=lambda b: b.where)
def test_a_runnable_block_works_as_written(block: Block) -> None:
    if block.language == "bash":
        done = _run(["bash", "-e", "-c", block.text])
        assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    elif block.language == "python":
        done = _run([sys.executable, "-"], stdin=block.text)
        assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stderr[-3000:]}"
    else:
        for command, expected in console_steps(block.text):
            done = _run(["bash", "-c", command])
            printed = (done.stdout + done.stderr).rstrip("\n").splitlines()
            assert matches(expected, printed), f"{block.where}: `{command}` printed\n" + "\n".join(printed)


def test_the_reference_shows_what_help_prints() -> None:
    """The CLI reference's `--help` blocks are what the commands print (for the top level and the drill)."""
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for command in (["sdcguard", "--help"], ["sdcguard", "drill", "--help"]):
        done = _run([str(Path(sys.executable).with_name("sdcguard")), *command[1:]])
        assert done.returncode == 0, done.stderr
        name = " ".join(c for c in command if c != "--help")
        shown = re.search(rf"^#+ `{name}`\n\n```text\n(.*?)\n```$", page, re.MULTILINE | re.DOTALL)
        assert shown is not None, name
        assert shown.group(1) == done.stdout.rstrip("\n"), f"docs/reference/cli.md: {name} --help differs"


# -- the pod names of a job run by hand against a seeded cluster ------------------------------------


def test_the_reference_job_names_its_pods_as_the_seed_does() -> None:
    """`sdcguard.agent.testing.train --node-names`: the ranks of node i run in pod <job>-worker-<i>, one pod per node."""
    from sdcguard.agent.testing.train import _node_env, parser

    args = parser().parse_args(["--nproc", "6", "--ranks-per-node", "2", "--node-names", "a,b,c"])
    env = _node_env(args)
    assert [env[f"POD_NAME@{r}"].rsplit("-", 1)[1] for r in range(6)] == ["0", "0", "1", "1", "2", "2"]
    assert [env[f"NODE_NAME@{r}"] for r in range(6)] == ["a", "a", "b", "b", "c", "c"]
