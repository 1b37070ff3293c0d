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
from collections.abc import Sequence

from sdcguard.errors import CommandError

__all__ = ["COMMANDS", "CommandError", "build_parser", "main"]

# name -> (module, one-line help). Order is the order of --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "schema": ("sdcguard.commands.schema", "print or check the JSON Schemas of the agent/pipeline contract"),
    "local": ("sdcguard.commands.local", "the local stand-in for AWS and EKS: up (run it), seed (fill it)"),
    "checkpoints": ("sdcguard.commands.checkpoints", "list checkpoints; choose the one to resume from and rewrite the resume pointer"),
    "deploy": ("sdcguard.commands.deploy", "package the pipeline and create or update its CloudFormation stack"),
    "destroy": ("sdcguard.commands.destroy", "delete the pipeline's CloudFormation stack"),
    "incidents": ("sdcguard.commands.incidents", "list incidents, or `incidents show ID`: state, suspects, evidence, timeline"),
    "approve": ("sdcguard.commands.incidents", "approve an incident's node replacement (starts the decision machine)"),
    "reject": ("sdcguard.commands.incidents", "reject an incident as a false alarm: release the node, resume the job"),
    "campaign": ("sdcguard.commands.campaign", "the fault-injection campaign: which detector catches how much corruption, against the baselines"),
    "drill": ("sdcguard.commands.drill", "the incident drill on the local stand-in: fault, alarm, approval, replacement, recovery"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdcguard",
        description=(
            "Catch silent data corruption in PyTorch DDP training, contain the node, "
            "and resume from a checkpoint known to be clean."
        ),
        epilog="Point it at AWS (or the local stand-in) with the usual AWS_* environment variables.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module)
        _configure(module, sub_parser)
    return parser


def _configure(module: str, parser: argparse.ArgumentParser) -> None:
    importlib.import_module(module).configure(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
