"""``sdcguard``: the operator command line.

Each subcommand's adapter lives in ``sdcguard/commands/`` and exposes
``configure(parser)`` and ``run(args) -> int``, calling the plain functions of
the part it drives; this file only dispatches, and
imports a subcommand's module only when that subcommand runs, so ``--help``
stays fast and the CLI never drags torch into a command that does not train.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Collection, Sequence

from sdcguard.errors import CommandError

__all__ = ["COMMANDS", "CommandError", "build_parser", "main"]

# name -> (module, one-line help). Order is the order of --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "schema": ("sdcguard.commands.schema", "print or check the JSON Schemas of the agent/pipeline contract"),
    "local": ("sdcguard.commands.local", "the local stand-in for AWS and EKS: up (run it), seed (fill it)"),
    "checkpoints": ("sdcguard.commands.checkpoints", "list checkpoints; choose the one to resume from and rewrite the resume pointer"),
    "deploy": ("sdcguard.commands.deploy", "package the pipeline and create or update its CloudFormation stack"),
    "destroy": ("sdcguard.commands.destroy", "delete the pipeline's CloudFormation stack"),
    "incidents": ("sdcguard.commands.incidents", "list open incidents (--all: every one), `incidents show ID`, "
                  "`incidents abort ID`, `incidents release ID`"),
    "approve": ("sdcguard.commands.incidents", "approve an incident's node replacement (starts the decision machine)"),
    "reject": ("sdcguard.commands.incidents", "reject an incident as a false alarm: release the node, resume the job"),
    "campaign": ("sdcguard.commands.campaign", "the fault-injection campaign: which detector catches how much corruption, against the baselines"),
    "drill": ("sdcguard.commands.drill", "the incident drill on the local stand-in: fault, alarm, approval, replacement, recovery"),
    "replay": ("sdcguard.commands.replay", "recompute a replay capsule on this machine's device N times: does the fault reproduce here?"),
}


def build_parser(configured: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line; only the subcommands in ``configured`` (default: all) get their options, and only
    their modules are imported (the others are listed by name and help)."""
    parser = argparse.ArgumentParser(
        prog="sdcguard",
        description=(
            "Catch silent data corruption in PyTorch training (DDP, HSDP, pure FSDP), contain the node, "
            "and resume from a checkpoint known to be clean."
        ),
        epilog="Point it at AWS (or the local stand-in) with the usual AWS_* environment variables.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module)
        if configured is None or name in configured:
            _configure(module, sub_parser)
    return parser


def _configure(module: str, parser: argparse.ArgumentParser) -> None:
    importlib.import_module(module).configure(parser)


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (its first word that is not an option), if it is one of ours."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the command that runs is imported (none for --help): `sdcguard local exec-credential`, which
    # kubectl starts for every call, does not pay for the drill's or the pipeline's imports.
    command = _command_in(argv)
    parser = build_parser(configured=[command] if command else [])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except CommandError as exc:
        print(f"sdcguard: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sdcguard: interrupted", file=sys.stderr)
        return 130
