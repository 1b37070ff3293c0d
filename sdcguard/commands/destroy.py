"""``sdcguard destroy``: the adapter of :func:`sdcguard.infra.deploy.destroy.destroy`."""

from __future__ import annotations

import argparse
import sys

import boto3

from sdcguard.errors import CommandError
from sdcguard.infra.deploy.destroy import DestroyError, destroy


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sdcguard destroy``."""
    parser.add_argument("--stack-name", required=True, help="the stack `sdcguard deploy` created")
    parser.add_argument("--region", help="AWS region (default: the environment's)")
    parser.add_argument(
        "--purge-code",
        metavar="CODE_BUCKET",
        help="also delete the objects deploy uploaded for this stack to CODE_BUCKET",
    )


def run(args: argparse.Namespace) -> int:
    """Destroy, printing progress on stderr and the final status on stdout."""
    try:
        status = destroy(
            args.stack_name,
            session=boto3.Session(region_name=args.region) if args.region else None,
            purge_code_bucket=args.purge_code,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except DestroyError as exc:
        raise CommandError(str(exc)) from None
    print(f"stack {args.stack_name}: {status}")
    return 0
