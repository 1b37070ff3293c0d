"""``sdcguard campaign``: the fault-injection campaign (how much silent corruption the detectors catch)."""

from __future__ import annotations

import argparse

from sdcguard.campaign import options


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = options.DESCRIPTION
    options.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from sdcguard.campaign.campaign import run_from_args  # torch: only when the campaign runs

    return run_from_args(args, prog="sdcguard campaign")
