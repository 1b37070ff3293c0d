"""``./dev check``: every static check the project has, in one run.

ruff and mypy on the whole tree; import-linter's layers contract
(``[tool.importlinter]`` in ``pyproject.toml``: imports point down only);
on the CloudFormation templates cfn-lint, checkov (security checks) and
parliament (every IAM policy against the real action and ARN catalogue), each
finding fixed or justified in ``infra/deploy/lint-exceptions.yaml`` (see
:mod:`sdcguard.infra.deploy.template_lint`); statelint on the state machines. checkov
runs from its own environment, ``.venv/tools/checkov``: when it is missing
the check fails and says so. ``mkdocs build --strict`` of the documentation
site (a broken link or anchor, a missing page, an unknown generated part
fails it). Exits non-zero if any fails, after running all of them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The installed package, sdcguard, reaches its parts through links (sdcguard/agent -> ../agent): mypy follows
# them and checks each module once, under its one name. ruff does not follow links, so it is given the folders.
PARTS = ["contract", "lineage", "agent", "lambdas", "infra", "campaign"]
PACKAGES = ["sdcguard", "tests", "benchmarks", "examples", "docs"]


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def checks() -> list[tuple[str, list[str]]]:
    """The commands to run, each with a label."""
    present = [p for p in PACKAGES if any((ROOT / p).rglob("*.py"))]
    parts = [p for p in PARTS if any((ROOT / p).rglob("*.py"))]
    out = [
        ("ruff", [_bin("ruff"), "check", *parts, *present]),
        ("mypy", [sys.executable, "-m", "mypy", *present]),
        ("import layers", [_bin("lint-imports")]),  # reads pyproject.toml in ROOT
    ]
    templates = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "infra" / "deploy").glob("*.yaml") if "template" in p.name
    )
    if templates:
        out.append(("cfn-lint", [_bin("cfn-lint"), *templates]))
        lint = [sys.executable, "-m", "sdcguard.infra.deploy.template_lint"]
        out.append(("checkov", [*lint, "checkov", *templates]))
        out.append(("iam policies (parliament)", [*lint, "parliament", *templates]))
    machines = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "stepfunctions").glob("*.asl.json"))
    if machines:
        # Resources are ${Placeholder}s until the template substitutes them.
        out.append(("statelint", [_bin("statelint"), "--ignore=URI", *machines]))
    if (ROOT / "mkdocs.yml").exists():
        # Not --quiet: it hides the warnings that --strict turns into a failure. Built into a folder of
        # its own, so a check never overwrites the site `./dev docs build` made.
        out.append(("docs", [_bin("mkdocs"), "build", "--strict", "--site-dir", str(ROOT / "build" / "check-site")]))
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
