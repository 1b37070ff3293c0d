"""``sdcguard schema``: print the contract's JSON Schemas, or check the checked-in copies."""

from __future__ import annotations

import argparse

from sdcguard.contract import schema


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", choices=sorted(schema.MODELS), help="print one schema")
    parser.add_argument("--check", action="store_true", help="exit 1 if a checked-in schema is stale")


def run(args: argparse.Namespace) -> int:
    if args.check:
        return schema.main(["--check"])
    names = [args.name] if args.name else sorted(schema.MODELS)
    for name in names:
        print(schema.render(schema.MODELS[name]), end="")
    return 0
