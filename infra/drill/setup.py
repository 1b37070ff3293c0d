"""Setting the stage: seed a simulated HyperPod cluster, deploy the pipeline onto it, warm its functions."""

from __future__ import annotations

import json
import time
from typing import Any

from sdcguard.infra.drill.failure import DrillFailed
from sdcguard.infra.drill.report import Say, Story
from sdcguard.infra.drill.stage import Stage, aws_environment


def prepare(standin: Any, *, name: str = "sdcguard-demo", nodes: int = 3, ranks_per_node: int = 2,
            say: Say = lambda line: None) -> Stage:
    """Seed a HyperPod cluster called ``name`` on ``standin`` and deploy the pipeline guarding it.

    The stack (also called ``name``) is deployed by ``sdcguard.infra.deploy.deploy.deploy``,
    the code path of ``sdcguard deploy``, reaching the stand-in through
    ``AWS_ENDPOINT_URL``. Raises :class:`DrillFailed` (step "set-up") when
    either fails.
    """
    from sdcguard.infra.deploy.deploy import DeployError, deploy
    from sdcguard.infra.local.seed import SeedError, seed

    story = Story(say)
    seconds: dict[str, float] = {}
    began = time.monotonic()
    try:
        seeded = seed(standin, nodes=nodes, ranks_per_node=ranks_per_node, faulty_node=None, cluster=name,
                      job=f"{name}-job", minutes=60)
    except SeedError as exc:
        raise DrillFailed("set-up", f"seeding the cluster failed: {exc}") from exc
    seconds["seed"] = round(time.monotonic() - began, 2)
    story.seeded(seeded["hyperpod_cluster"], seeded["nodes"])
    began = time.monotonic()
    overrides = {
        "HyperPodClusterName": seeded["hyperpod_cluster"],
        "EksClusterName": seeded["eks_cluster"],
        "JobNamespace": seeded["namespace"],
        "JobName": seeded["job"],
        "CheckpointBucket": seeded["bucket"],
        "CheckpointPrefix": seeded["checkpoint_prefix"],
        "EventBusName": f"{name}-bus",
        # The drill's ranks publish with the stand-in's own credentials, not as a training role.
        "AllowAnyPublisher": "true",
        "ReviewerEmail": "oncall@example.com",
        "ApprovalTimeoutSeconds": "3600",
        "MaxQuarantinedNodes": "2",
        "MaxReplacementsPerDay": "20",
        "ReplacementPollSeconds": "1",
        "ReplacementMaxPolls": "60",
        # The node checks' Jobs replay a tiny capsule in seconds on the stand-in: ask every second, and call
        # one still running after a minute inconclusive (the polls outlast the Job's deadline and keep the
        # execution history's worst case, two replacement rounds included, under its limit).
        "NodeCheckPollSeconds": "1",
        "NodeCheckDeadlineSeconds": "60",
        "NodeCheckMaxPolls": "90",
    }
    with aws_environment(standin.env):
        try:
            result = deploy(name, overrides, progress=story.deploying, poll_seconds=0.2)
        except DeployError as exc:
            raise DrillFailed("set-up", f"deploying the pipeline failed: {exc}") from exc
    seconds["deploy"] = round(time.monotonic() - began, 2)
    story.deployed(result.stack_name, result.status, seconds["deploy"], result.outputs["EventBusName"],
                   result.outputs["LedgerTableName"])
    stage = Stage(standin, seeded, result.stack_name, result.outputs, seconds)
    story.warming()
    began = time.monotonic()
    warmed = warm_functions(stage)
    seconds["warm_functions"] = round(time.monotonic() - began, 2)
    story.warmed(warmed, seconds["warm_functions"])
    return stage


WARM_UP = {"sdcguard_drill_warm_up": True}


def warm_functions(stage: Stage) -> int:
    """Invoke every Lambda function of the stack once with an input each refuses, so later calls are warm.

    Every handler parses its input into a model that forbids unknown fields,
    so the warm-up call fails at once (``MalformedEvent``) and touches
    nothing; what it leaves is the stand-in's worker process with the code
    imported. Returns how many functions were warmed.
    """
    from concurrent.futures import ThreadPoolExecutor

    cfn = stage.client("cloudformation")
    pages = cfn.get_paginator("list_stack_resources").paginate(StackName=stage.stack_name)
    names = [r["PhysicalResourceId"] for p in pages for r in p["StackResourceSummaries"]
             if r["ResourceType"] == "AWS::Lambda::Function"]
    lam = stage.client("lambda")
    payload = json.dumps(WARM_UP).encode()
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        list(pool.map(lambda name: lam.invoke(FunctionName=name, Payload=payload)["StatusCode"], names))
    return len(names)
