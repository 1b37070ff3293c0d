"""``sdcguard checkpoints``: list a job's checkpoints, and choose (and point at) the one to resume from.

``select --suspect-since STEP`` applies exactly the rule the pipeline applies
(:func:`sdcguard.lineage.selection.select_checkpoint`), with STEP in the role of an
alarm's :meth:`sdcguard.contract.Alarm.trusted_through_step`; ``--alarm FILE`` computes
it from a stored alarm.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sdcguard.contract.alarm import Alarm
from sdcguard.errors import CommandError
from sdcguard.lineage.errors import CheckpointCorrupt, CheckpointIncomplete, LineageError, NoSafeCheckpoint
from sdcguard.lineage.listing import list_checkpoints
from sdcguard.lineage.pointer import read_pointer, rewrite_pointer_explained
from sdcguard.lineage.selection import Selection, select_checkpoint
from sdcguard.lineage.store import ObjectStore, open_store
from sdcguard.lineage.verify import read_manifest, verify_checkpoint

SUSPECT_SINCE_HELP = (
    "the first step whose update is suspect. A checkpoint's step is the first step a resumed job "
    "runs (it holds the updates of steps 0..step-1), so a checkpoint qualifies when its step is <= STEP. "
    "For an alarm this is the alarm's trusted-through step (the earlier of the last clean ring audit and "
    "the last clean weight check; the alarm's own step for per-step detectors); the pipeline passes the "
    "same number to the same function"
)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``list`` and ``select`` subcommands."""
    sub = parser.add_subparsers(dest="checkpoints_command", metavar="SUBCOMMAND", required=True)

    lister = sub.add_parser(
        "list",
        help="list the checkpoints under a prefix: step, time, committed, verified, fingerprint",
        description="List every checkpoint folder under PREFIX, oldest first, verifying each committed one.",
    )
    lister.add_argument("prefix", metavar="PREFIX", help="s3://bucket/prefix or a local directory")
    lister.add_argument("--no-verify", action="store_true", help="skip reading the objects (verified shows '-')")
    lister.add_argument("--json", action="store_true", help="print a JSON list of objects")

    selector = sub.add_parser(
        "select",
        help="choose the newest committed, verified checkpoint at or before a step",
        description=(
            "Choose the newest committed checkpoint whose objects verify and whose step is at or before "
            "the suspect step, print why each newer one was passed over, and optionally rewrite the "
            "resume pointer (conditionally; it never moves forward and keeps its history). "
            "Exits 1 with 'nothing safe to resume from' when none qualifies."
        ),
    )
    selector.add_argument("prefix", metavar="PREFIX", help="s3://bucket/prefix or a local directory")
    which = selector.add_mutually_exclusive_group(required=True)
    which.add_argument("--suspect-since", type=int, metavar="STEP", help=SUSPECT_SINCE_HELP)
    which.add_argument("--alarm", type=Path, metavar="FILE", help="an alarm JSON (the EventBridge event or its detail): use its trusted-through step")
    selector.add_argument("--write-pointer", action="store_true", help="rewrite PREFIX/RESUME.json to the choice")
    selector.add_argument("--reason", default="", help="why (recorded in the pointer; default names the step)")
    selector.add_argument("--incident-id", default=None, help="the incident this rewrite belongs to")
    selector.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run ``checkpoints list`` or ``checkpoints select``; raises CommandError for user-facing failures."""
    try:
        store = open_store(args.prefix)
        if args.checkpoints_command == "list":
            return _list(store, verify=not args.no_verify, as_json=args.json)
        return _select(store, args)
    except NoSafeCheckpoint as exc:
        detail = "".join(f"\n  step {p.step}: {p.reason}" for p in exc.passed_over[:20])
        raise CommandError(f"{exc}{detail}") from exc
    except (LineageError, ValueError) as exc:
        raise CommandError(str(exc)) from exc


def _list(store: ObjectStore, *, verify: bool, as_json: bool) -> int:
    rows: list[dict[str, Any]] = []
    for folder in list_checkpoints(store):
        row: dict[str, Any] = {
            "step": folder.step,
            "checkpoint": folder.dir,
            "committed": folder.committed,
            "verified": None,
            "time": None,
            "fingerprint": None,
            "problem": None if folder.committed else "incomplete: no manifest",
        }
        if folder.committed:
            try:
                manifest = read_manifest(store, folder.step)
                row.update(time=manifest.created_at.isoformat(), fingerprint=manifest.fingerprint)
                if verify:
                    verify_checkpoint(store, folder.step)
                    row["verified"] = True
            except (CheckpointCorrupt, CheckpointIncomplete) as exc:
                row.update(verified=False, problem=str(exc))
        else:
            row["verified"] = False if verify else None
        rows.append(row)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no checkpoints under {store.uri()}")
        return 0
    print(f"{'STEP':>10}  {'TIME':<32}  {'COMMITTED':<9}  {'VERIFIED':<8}  FINGERPRINT")
    for row in rows:
        verified = "-" if row["verified"] is None else ("yes" if row["verified"] else "NO")
        print(
            f"{row['step']:>10}  {row['time'] or '-':<32}  {'yes' if row['committed'] else 'NO':<9}  "
            f"{verified:<8}  {row['problem'] or row['fingerprint']}"
        )
    return 0


def _trusted_step(args: argparse.Namespace) -> int:
    if args.suspect_since is not None:
        if args.suspect_since < 0:
            raise CommandError(f"--suspect-since: must be >= 0, got {args.suspect_since}")
        return int(args.suspect_since)
    try:
        document = json.loads(args.alarm.read_bytes())
    except OSError as exc:
        raise CommandError(f"--alarm: cannot read {args.alarm}: {exc.strerror}") from exc
    except ValueError as exc:
        raise CommandError(f"--alarm: {args.alarm} is not JSON: {exc}") from exc
    # Accept the whole EventBridge event as well as its detail.
    if isinstance(document, dict) and "detail-type" in document and "detail" in document:
        document = document["detail"]
    try:
        alarm = Alarm.model_validate(document)
    except ValidationError as exc:
        raise CommandError(f"--alarm: {args.alarm} is not a valid alarm: {exc}") from exc
    return alarm.trusted_through_step()


def _select(store: ObjectStore, args: argparse.Namespace) -> int:
    trusted = _trusted_step(args)
    if args.write_pointer:
        who = f"sdcguard checkpoints select ({getpass.getuser()}@{socket.gethostname()})"
        reason = args.reason or f"operator: last verified checkpoint at or before step {trusted}"
        rewrite = rewrite_pointer_explained(
            store, trusted_through_step=trusted, reason=reason, written_by=who, incident_id=args.incident_id
        )
        # The rewrite chose at or before min(trusted, the pointer's step): the pointer
        # never moves forward. The trusted step is still the one asked for; the
        # pointer's own step is reported as what held the choice back.
        selection = replace(rewrite.selection, trusted_through_step=trusted)
        previous = rewrite.previous
        held_back = previous is not None and previous.step < trusted and selection.step == previous.step
        pointer: dict[str, Any] | None = {
            "uri": store.uri("RESUME.json"),
            "written": rewrite.written,
            "step": rewrite.pointer.step,
            "previous_step": previous.step if previous else None,
            "kept_behind": held_back,
        }
    else:
        selection = select_checkpoint(store, trusted)
        current, _ = read_pointer(store)
        pointer = {"uri": store.uri("RESUME.json"), "written": False, "step": current.step if current else None}
    _print_selection(selection, pointer, as_json=args.json)
    return 0


def _print_selection(selection: Selection, pointer: dict[str, Any] | None, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**selection.to_dict(), "pointer": pointer}, indent=2))
        return
    print(f"chosen: step {selection.step}  {selection.uri}")
    print(f"  trusted through step {selection.trusted_through_step}; fingerprint {selection.manifest.fingerprint}")
    for passed in selection.passed_over:
        print(f"  passed over step {passed.step}: {passed.reason}")
    if pointer and pointer["written"]:
        was = "none before" if pointer["previous_step"] is None else f"was step {pointer['previous_step']}"
        print(f"resume pointer {pointer['uri']} now at step {pointer['step']} ({was})")
        if pointer.get("kept_behind"):
            print(f"  the pointer never moves forward: it was already at step {pointer['step']}, "
                  f"before the trusted step {selection.trusted_through_step}")
    elif pointer:
        at = "no pointer yet" if pointer["step"] is None else f"at step {pointer['step']}"
        print(f"resume pointer {pointer['uri']} unchanged ({at})")
