"""``./dev check``: every static check the project has, in one run.

ruff and mypy on the whole tree; import-linter's layers contract
(``[tool.importlinter]`` in ``pyproject.toml``: imports point down only);
cfn-lint on the CloudFormation templates and statelint on the state machines
when they exist. Exits non-zero if any fails,
after running all of them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["contract", "lineage", "agent", "lambdas", "infra", "sdcguard", "tests", "benchmarks"]


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def checks() -> list[tuple[str, list[str]]]:
    """The commands to run, each with a label."""
    present = [p for p in PACKAGES if any((ROOT / p).rglob("*.py"))]
    out = [
        ("ruff", [_bin("ruff"), "check", *present]),
        ("mypy", [sys.executable, "-m", "mypy", *present]),
        ("import layers", [_bin("lint-imports")]),  # reads pyproject.toml in ROOT
    ]
    templates = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "infra" / "deploy").glob("*.yaml") if "template" in p.name
    )
    if templates:
        out.append(("cfn-lint", [_bin("cfn-lint"), *templates]))
    machines = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "stepfunctions").glob("*.asl.json"))
    if machines:
        # Resources are ${Placeholder}s until the template substitutes them.
        out.append(("statelint", [_bin("statelint"), "--ignore=URI", *machines]))
    return out


def main() -> int:
    failed = []
    for label, command in checks():
        print(f"== {label}", flush=True)
        if subprocess.call(command, cwd=ROOT) != 0:
            failed.append(label)
    if failed:
        print(f"check: FAILED: {', '.join(failed)}")
        return 1
    print("check: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
