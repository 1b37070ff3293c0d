"""The chaos drill's knobs: a fraction of the pipeline's Kubernetes API and SageMaker HyperPod calls fail.

``DrillChaos`` turns the stand-in's two chaos knobs (the EKS server's
``faults.chaos`` and ``hyperpod_faults.chaos``) on for the part of the drill
where the pipeline runs, and reads back what they did. The drill's own reads
of the cluster (to check what the pipeline did) run inside ``paused()``: they
are the drill's observations, not the system under test, and a fault there
would test the drill rather than the pipeline.

Retries are counted twice, from both sides: on the stand-in (a faulted call
that a later attempt of the same call followed: a client's resend, or a
Lambda invocation the state machine retried), and in the incident
execution's history (the Lambda invocations each state retried, and the
errors those retries absorbed).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from sdcguard.infra.drill.summary import CallChaos, ChaosSummary
from sdcguard.infra.local.eks.faults import Chaos, ChaosTally

_TASK_ENTERED = "TaskStateEntered"
# A Task calls Lambda through the service integration (``arn:aws:states:::lambda:invoke``: Task* events) or
# by the function's ARN (LambdaFunction* events); the state machines use the first, both are read.
_SCHEDULED = ("TaskScheduled", "LambdaFunctionScheduled")
_FAILED = {
    "TaskFailed": "taskFailedEventDetails",
    "TaskTimedOut": "taskTimedOutEventDetails",
    "LambdaFunctionFailed": "lambdaFunctionFailedEventDetails",
    "LambdaFunctionTimedOut": "lambdaFunctionTimedOutEventDetails",
}


class DrillChaos:
    """Both chaos knobs of one stand-in, seeded from one seed; off until ``on()``."""

    def __init__(self, standin: Any) -> None:
        from sdcguard.infra.local.moto_ext import hyperpod_faults

        eks = standin.eks
        self.knobs: dict[str, Chaos] = {"hyperpod": hyperpod_faults.chaos}
        if eks is not None:
            self.knobs["kubernetes"] = eks.faults.chaos
        self.rate = 0.0
        self.seed = 0

    def on(self, rate: float, seed: int) -> None:
        """Fail ``rate`` of the calls from now on (the counts start again); ValueError for a rate out of range."""
        for knob in self.knobs.values():
            knob.set(rate, seed=seed)
        self.rate, self.seed = rate, seed

    def off(self) -> None:
        """Stop failing calls; the counts stay readable."""
        for knob in self.knobs.values():
            knob.off()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let the drill's own calls through, uncounted."""
        with contextlib.ExitStack() as stack:
            for knob in self.knobs.values():
                stack.enter_context(knob.paused())
            yield

    def tallies(self) -> dict[str, ChaosTally]:
        """What each knob did since ``on()``: "kubernetes" and "hyperpod"."""
        return {name: knob.tally() for name, knob in self.knobs.items()}


def state_retries(history: list[dict[str, Any]]) -> tuple[Counter[str], Counter[str]]:
    """From one execution's history: Lambda re-invocations per state, and the errors they followed.

    A state's retries are its Lambda invocations beyond one per entry into
    the state; the errors are the failed invocations that a further
    invocation in the same state followed, as ``"State: Error"``.
    """
    entered: Counter[str] = Counter()
    scheduled: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    failed_last: dict[str, str] = {}
    state = ""
    for event in history:
        kind = event.get("type", "")
        if kind == _TASK_ENTERED:
            state = event.get("stateEnteredEventDetails", {}).get("name", "")
            entered[state] += 1
            failed_last.pop(state, None)
        elif kind in _SCHEDULED:
            scheduled[state] += 1
            if state in failed_last:
                errors[f"{state}: {failed_last.pop(state)}"] += 1
        elif kind in _FAILED:
            failed_last[state] = event.get(_FAILED[kind], {}).get("error") or kind
    retries = Counter({s: scheduled[s] - entered[s] for s in scheduled if scheduled[s] > entered[s]})
    return retries, errors


def incident_history(sfn: Any, machine_arn: str, incident_id: str) -> list[dict[str, Any]]:
    """The history of the incident machine's execution that handled ``incident_id`` ([] when none is found)."""
    pages = sfn.get_paginator("list_executions").paginate(stateMachineArn=machine_arn)
    for execution in (e for page in pages for e in page["executions"]):
        events = _history(sfn, execution["executionArn"])
        for event in events:
            details = event.get("stateEnteredEventDetails", {})
            if details.get("name") == "Resolve" and incident_id in details.get("input", ""):
                return events
    return []


def _history(sfn: Any, arn: str) -> list[dict[str, Any]]:
    pages = sfn.get_paginator("get_execution_history").paginate(executionArn=arn)
    return [event for page in pages for event in page["events"]]


def summarise(chaos: DrillChaos, history: list[dict[str, Any]], incidents_opened: int) -> ChaosSummary:
    """The chaos part of the drill's summary: faults per call, retries from both sides."""
    return summary_of(chaos.tallies(), chaos.rate, chaos.seed, history, incidents_opened)


def summary_of(tallies: dict[str, ChaosTally], rate: float, seed: int, history: list[dict[str, Any]],
               incidents_opened: int) -> ChaosSummary:
    """``summarise`` from the knobs' tallies ("kubernetes", "hyperpod") and the incident execution's history."""
    by_call: dict[str, CallChaos] = {}
    retried = outstanding = injected = 0
    for side, tally in tallies.items():
        injected += tally.faults
        retried += sum(tally.retried.values())
        outstanding += sum(tally.outstanding.values())
        for operation, statuses in sorted(tally.injected.items()):
            by_call[f"{side} {operation}"] = CallChaos(
                injected={str(status): n for status, n in sorted(statuses.items())},
                retried=tally.retried.get(operation, 0),
            )
    retries, errors = state_retries(history)
    return ChaosSummary(
        rate=rate, seed=seed, faults_injected=injected, retries_absorbed=retried,
        not_retried=outstanding, by_call=by_call, state_retries=dict(sorted(retries.items())),
        state_errors=dict(sorted(errors.items())), incidents_opened=incidents_opened,
    )
