"""``sdcguard destroy``: delete the pipeline's stack, following its events until it is gone.

The incident ledger is kept (the template retains it: it is the audit trail),
and so are the code bucket's objects unless ``--purge-code`` is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
from botocore.exceptions import ClientError

from sdcguard.infra.deploy.stack_events import StackTimeout, follow, last_event


class DestroyError(RuntimeError):
    """The stack could not be deleted; the message says why."""


def destroy(
    stack_name: str,
    *,
    session: boto3.Session | None = None,
    purge_code_bucket: str | None = None,
    progress: Callable[[str], None] | None = None,
    poll_seconds: float = 2.0,
    timeout_seconds: float = 3600.0,
) -> str:
    """Delete the stack ``stack_name`` and wait until it is gone; returns its final status.

    With ``purge_code_bucket``, also deletes what ``sdcguard deploy`` uploaded
    for this stack there (``sdcguard/<stack>/``). Raises :class:`DestroyError`
    when there is no such stack or the deletion fails.
    """
    say = progress or (lambda line: None)
    session = session or boto3.Session()
    cfn = session.client("cloudformation")
    try:
        stack = cfn.describe_stacks(StackName=stack_name)["Stacks"][0]
    except ClientError as exc:
        if "does not exist" in str(exc):
            raise DestroyError(f"no stack named {stack_name!r} in this account and region") from None
        raise
    stack_id = stack["StackId"]
    since, skip = last_event(cfn, stack_id)
    say(f"deleting stack {stack_name}")
    cfn.delete_stack(StackName=stack_id)
    try:
        settled = follow(
            cfn, stack_id, since=since, skip=skip, on_event=say,
            poll_seconds=poll_seconds, timeout_seconds=timeout_seconds,
        )  # fmt: skip
    except StackTimeout as exc:
        raise DestroyError(str(exc)) from None
    if settled.status != "DELETE_COMPLETE":
        raise DestroyError(f"stack {stack_name} ended {settled.status}: {'; '.join(settled.failures)}")
    if purge_code_bucket:
        removed = _purge(session.client("s3"), purge_code_bucket, f"sdcguard/{stack_name}/")
        say(f"removed {removed} object(s) from s3://{purge_code_bucket}/sdcguard/{stack_name}/")
    return settled.status


def _purge(s3: Any, bucket: str, prefix: str) -> int:
    removed = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            removed += len(keys)
    return removed
