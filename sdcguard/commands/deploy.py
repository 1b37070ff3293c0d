"""``sdcguard deploy``: the adapter of :func:`sdcguard.infra.deploy.deploy.deploy` (arguments, progress, outputs)."""

from __future__ import annotations

import argparse
import json
import sys

import boto3

from sdcguard.errors import CommandError
from sdcguard.infra.deploy.deploy import DeployError, default_target, deploy, parse_overrides


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sdcguard deploy``."""
    parser.add_argument("--stack-name", required=True, help="CloudFormation stack name (e.g. sdcguard)")
    parser.add_argument(
        "--parameter-overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="template parameters, e.g. HyperPodClusterName=ml-cluster EksClusterName=ml-eks "
        "JobNamespace=training JobName=llama CheckpointBucket=my-ckpts CheckpointPrefix=jobs/llama "
        "ReviewerEmail=oncall@example.com (without JobNamespace and JobName every alarm is refused)",
    )
    parser.add_argument("--region", help="AWS region (default: the environment's)")
    parser.add_argument("--code-bucket", help="bucket for the package (default: sdcguard-code-ACCOUNT-REGION)")
    parser.add_argument(
        "--python-version",
        help="Python of the package (default: 3.12, the Lambda runtime; this interpreter's with AWS_ENDPOINT_URL)",
    )
    parser.add_argument("--architecture", choices=["arm64", "x86_64"], help="Lambda architecture (default arm64)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    """Deploy, printing progress on stderr and the outputs on stdout."""
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        overrides = parse_overrides(args.parameter_overrides)
        target = default_target(
            architecture=args.architecture or overrides.get("LambdaArchitecture"),
            python_version=args.python_version,
        )
        result = deploy(
            args.stack_name,
            overrides,
            session=boto3.Session(region_name=args.region) if args.region else None,
            code_bucket=args.code_bucket,
            target=target,
            progress=progress,
        )
    except (DeployError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(json.dumps(result.as_json(), indent=2, sort_keys=True))
    else:
        print(f"stack {result.stack_name}: {result.status}{'' if result.changed else ' (unchanged)'}")
        for key, value in sorted(result.outputs.items()):
            print(f"  {key} = {value}")
    return 0
