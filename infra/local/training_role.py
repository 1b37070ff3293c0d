"""The training job's identity on the stand-in: a role with the deployed stack's TrainingPolicy, assumed.

The stand-in enforces IAM (``sdcguard.infra.local.moto_ext.iam_enforcement``), so a
job that runs with these credentials may do what the TrainingPolicy allows
and nothing more, as the agent in a training pod on AWS.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

import boto3


def training_role_env(env: Mapping[str, str], checkpoint_prefix: str) -> dict[str, str]:
    """``env`` (the stand-in's, an administrator's) with the credentials of a new role that holds the deployed
    stack's TrainingPolicy for ``checkpoint_prefix`` (``s3://bucket/prefix``), as the training pods' role does on AWS.

    A job under another prefix of the same bucket (the drill's clean
    reference run) gets that policy rewritten for its own prefix, as a stack
    deployed for that prefix would grant it. Raises ``LookupError`` unless
    exactly one deployed TrainingPolicy grants objects of that bucket.
    """
    bucket, _, prefix = checkpoint_prefix.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    session = boto3.Session(
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_REGION"],
    )  # fmt: skip
    iam = session.client("iam", endpoint_url=env["AWS_ENDPOINT_URL"])
    found: list[tuple[str, dict[str, Any]]] = []
    for page in iam.get_paginator("list_policies").paginate(Scope="Local"):
        for policy in page["Policies"]:
            if "TrainingPolicy" not in policy["PolicyName"]:
                continue
            version = iam.get_policy_version(PolicyArn=policy["Arn"], VersionId=policy["DefaultVersionId"])
            raw: Any = version["PolicyVersion"]["Document"]
            parsed: dict[str, Any] = json.loads(raw) if isinstance(raw, str) else dict(raw)
            if f"arn:aws:s3:::{bucket}/" in json.dumps(parsed):
                found.append((policy["Arn"], parsed))
    if len(found) != 1:
        raise LookupError(
            f"the agent runs as the training role: expected one deployed TrainingPolicy for bucket {bucket}, "
            f"found {len(found)} (deploy the stack first)"
        )
    policy_arn, document = found[0]
    name = f"sdcguard-training-{uuid.uuid4().hex[:8]}"
    trust = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "pods.eks.amazonaws.com"}, "Action": ["sts:AssumeRole", "sts:TagSession"]}]}  # fmt: skip
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    stack_prefix = _granted_prefix(document, bucket)
    if stack_prefix == prefix:
        iam.attach_role_policy(RoleName=name, PolicyArn=policy_arn)
    else:
        own = json.loads(json.dumps(document).replace(f"{bucket}/{stack_prefix}/", f"{bucket}/{prefix}/")
                         .replace(f'"{stack_prefix}/*"', f'"{prefix}/*"').replace(f'"{stack_prefix}"', f'"{prefix}"'))  # fmt: skip
        iam.put_role_policy(RoleName=name, PolicyName="training", PolicyDocument=json.dumps(own))
    sts = session.client("sts", endpoint_url=env["AWS_ENDPOINT_URL"])
    credentials = sts.assume_role(RoleArn=arn, RoleSessionName="training", DurationSeconds=12 * 3600)["Credentials"]
    return {
        **env,
        "AWS_ACCESS_KEY_ID": credentials["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": credentials["SecretAccessKey"],
        "AWS_SESSION_TOKEN": credentials["SessionToken"],
    }


def _granted_prefix(document: dict[str, Any], bucket: str) -> str:
    """The prefix whose objects ``document`` grants in ``bucket`` (``arn:aws:s3:::bucket/PREFIX/*``)."""
    match = re.search(rf"arn:aws:s3:::{re.escape(bucket)}/(.+?)/\*", json.dumps(document))
    if match is None:
        raise LookupError(f"the TrainingPolicy grants no objects of {bucket}")
    return match.group(1)
