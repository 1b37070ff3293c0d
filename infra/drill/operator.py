"""The person in the loop: the operator CLI as the drill runs it, and the prompt of ``--interactive``."""

from __future__ import annotations

import contextlib
import io
import sys

from sdcguard.contract import Incident
from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.options import REVIEWER_REASON
from sdcguard.infra.drill.stage import Stage


def run_operator(stage: Stage, argv: list[str]) -> tuple[int, list[str]]:
    """Run the operator CLI (``sdcguard ...``) as ``stage.operator``; its exit status and output lines."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = stage.operator(argv)
        except SystemExit as exc:  # argparse refusing the arguments
            status = int(exc.code or 0) if not isinstance(exc.code, str) else 2
    return status, [line for line in out.getvalue().splitlines() if line.strip()]


def prompt(question: str) -> str:
    """Ask on stderr (stdout may carry the JSON summary) and read one line; DrillFailed at end of input."""
    sys.stderr.write(question)
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        raise DrillFailed("decision", "no answer: standard input closed")
    return line.strip()


def ask(incident: Incident) -> tuple[str, str]:
    """Ask the person at the keyboard to approve or reject; (decision, reason)."""
    instances = ", ".join(incident.instance_ids) or "?"
    while True:
        answer = prompt(f"approve the replacement of {instances}? [a]pprove / [r]eject: ").lower()
        if answer in ("a", "approve", "y", "yes"):
            decision = "approve"
            break
        if answer in ("r", "reject", "n", "no"):
            decision = "reject"
            break
        sys.stderr.write("please answer a (approve) or r (reject)\n")
    reason = prompt("reason (recorded in the ledger): ") or REVIEWER_REASON
    return decision, reason
