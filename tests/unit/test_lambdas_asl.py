"""The state machines: valid ASL, only the agreed placeholders, Retry/Catch on every task, bounded waits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdcguard.lambdas import errors

ROOT = Path(__file__).resolve().parents[2]
LAMBDA = "arn:aws:states:::lambda:invoke"
MACHINES = {name: ROOT / "stepfunctions" / f"{name}.asl.json" for name in ("incident", "decide")}
PLACEHOLDERS = {
    f"${{{name}FunctionArn}}"
    for name in ["Record", "Resolve", "Guard", "SuspendJob", "Cordon", "StartNodeCheck", "NodeCheckStatus", "Evidence", "RequestApproval", "Replace", "ReplacementStatus", "RejectReplacement", "RewritePointer", "ResumeJob", "Close", "Release", "NeedsAttention", "Fail", "Decide"]
} | {"${TopicArn}"}
REPRODUCE = ("StartReproduce", "ReproduceStarted", "WaitReproduce", "CheckReproduce", "ReproduceDone")
"""ReproduceOnSuspect's states: between the cordon and the evidence, informing the reviewers only."""


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(MACHINES[name].read_text())
    return data


def all_states(machine: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, state in machine["States"].items():
        yield name, state
        inner = state.get("ItemProcessor") or state.get("Iterator")
        if inner:
            yield from all_states(inner)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_statelint_accepts_the_machine(name: str) -> None:
    statelint = str(Path(sys.executable).with_name("statelint"))
    result = subprocess.run([statelint, "--ignore=URI", str(MACHINES[name])], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_only_the_agreed_placeholders_are_used() -> None:
    used = set()
    for path in MACHINES.values():
        used |= set(re.findall(r"\$\{[A-Za-z]+\}", path.read_text()))
    assert used <= PLACEHOLDERS
    assert used == PLACEHOLDERS  # every handler is wired somewhere


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_task_retries_transient_errors_and_catches_into_a_recorded_state(name: str) -> None:
    machine = load(name)
    top = machine["States"]
    for state_name, state in all_states(machine):
        if state["Type"] != "Task":
            continue
        retried = {e for r in state.get("Retry", []) for e in r["ErrorEquals"]}
        if state["Resource"].startswith(LAMBDA):
            assert "Lambda.ServiceException" in retried, state_name
            assert "Lambda.TooManyRequestsException" in retried, state_name  # the invocation was throttled: never ran
            if name == "incident":  # every incident handler is idempotent, so a timed-out one may run again
                assert "Sandbox.Timedout" in retried, state_name
        else:  # the direct SNS notifications: a publish may be repeated
            assert state["Resource"] == "arn:aws:states:::sns:publish", state_name
            assert "States.TaskFailed" in retried, state_name
        assert all(r["IntervalSeconds"] <= 2 and r["MaxAttempts"] <= 4 for r in state["Retry"]), state_name
        if state_name in top:  # Map iterations are caught by their Map
            assert state.get("Catch"), state_name
    for state_name, state in top.items():
        for catch in state.get("Catch", []):
            if state_name in REPRODUCE:  # the reproduction's failure is kept beside the input, not an error of the incident
                assert (catch["ResultPath"], catch["Next"]) == ("$.reproduce_error", "CollectEvidence"), state_name
            else:
                assert catch["ResultPath"] in ("$.error", "$.notify_error"), state_name
            assert catch["Next"] in top


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_caught_error_names_exist(name: str) -> None:
    for state_name, state in all_states(load(name)):
        for clause in state.get("Catch", []) + state.get("Retry", []):
            for error in clause["ErrorEquals"]:
                if error.startswith(("States.", "Lambda.", "Sandbox.")):
                    continue
                assert isinstance(getattr(errors, error, None), type), f"{state_name} catches unknown {error}"


def test_the_approval_waits_for_a_token_with_timeouts_from_the_data() -> None:
    approval = load("incident")["States"]["RequestApproval"]
    assert approval["Resource"].endswith(".waitForTaskToken")
    assert approval["Parameters"]["Payload"]["task_token.$"] == "$$.Task.Token"
    assert approval["TimeoutSecondsPath"] == "$.timeouts.approval_seconds"
    assert approval["HeartbeatSecondsPath"] == "$.timeouts.approval_heartbeat_seconds"
    timeouts = {e for c in approval["Catch"] for e in c["ErrorEquals"] if e in ("States.Timeout", "States.HeartbeatTimeout")}
    assert timeouts == {"States.Timeout", "States.HeartbeatTimeout"}


def test_the_replacement_wait_loop_is_bounded_and_fails_into_a_recorded_state() -> None:
    states = load("incident")["States"]
    loop = states["ReplacementDone"]
    targets = {c["Variable"]: c["Next"] for c in loop["Choices"]}
    assert targets["$.poll.done"] == "StartQualify"  # the new nodes qualify before anything resumes onto them
    assert states[targets["$.poll.exhausted"]]["Next"] == "Failed"
    assert loop["Default"] == "WaitForReplacement"
    assert states["WaitForReplacement"]["SecondsPath"] == "$.timeouts.replacement_poll_seconds"


def test_every_path_ends_and_every_state_is_reachable() -> None:
    states = load("incident")["States"]
    seen, todo = set(), ["Record"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        state = states[name]
        nexts = [state.get("Next"), state.get("Default")]
        nexts += [c["Next"] for c in state.get("Choices", []) + state.get("Catch", [])]
        todo.extend(n for n in nexts if n)
        if not any(nexts):
            assert state["Type"] in ("Succeed", "Fail") or state.get("End"), name
    assert seen == set(states)


def test_the_suspect_instances_are_mapped() -> None:
    states = load("incident")["States"]
    for name in ("CordonNodes", "ReplaceNodes"):
        assert states[name]["Type"] == "Map"
        assert states[name]["ItemsPath"] == "$.resolved.instance_ids"


def test_incident_tasks_retry_throttling_that_outlasted_the_clients() -> None:
    for state_name, state in all_states(load("incident")):
        if state["Type"] == "Task" and state["Resource"].startswith(LAMBDA):
            retried = {e for r in state["Retry"] for e in r["ErrorEquals"]}
            assert "Throttled" in retried, state_name


def test_a_failing_end_handler_still_ends_with_a_direct_notification() -> None:
    states = load("incident")["States"]
    for handler, fallback, end in (
        ("NeedsAttention", "NotifyAttentionDirectly", "StoppedForAttention"),
        ("ApprovalTimedOut", "NotifyAttentionDirectly", "StoppedForAttention"),
        ("Failed", "NotifyFailureDirectly", "IncidentFailed"),
    ):
        (catch,) = states[handler]["Catch"]
        assert (catch["ErrorEquals"], catch["Next"]) == (["States.ALL"], fallback), handler
        publish = states[fallback]
        assert publish["Resource"] == "arn:aws:states:::sns:publish"
        assert publish["Parameters"]["TopicArn.$"] == "$.topic_arn"
        assert "$.incident_id" in publish["Parameters"]["Message.$"]
        assert publish["Next"] == end
        assert [c["Next"] for c in publish["Catch"]] == [end]
    # the topic travels in the data from the first state on
    assert states["Record"]["ResultSelector"]["topic_arn.$"] == "$.Payload.topic_arn"
    assert states["Opened"]["Parameters"]["topic_arn.$"] == "$.recorded.topic_arn"


def test_a_refused_alarm_whose_fail_handler_fails_still_ends_with_a_direct_notification() -> None:
    states = load("incident")["States"]
    assert [c["Next"] for c in states["Record"]["Catch"]] == ["AlarmRefused"]
    (catch,) = states["AlarmRefused"]["Catch"]
    assert (catch["ErrorEquals"], catch["Next"]) == (["States.ALL"], "NotifyRefusalDirectly")
    publish = states["NotifyRefusalDirectly"]
    assert publish["Resource"] == "arn:aws:states:::sns:publish"
    # Nothing was recorded that would carry the topic: it comes from the definition.
    assert publish["Parameters"]["TopicArn"] == "${TopicArn}"
    # Only names and the execution: the refusal's cause quotes the alarm, which may be anyone's text.
    message = publish["Parameters"]["Message.$"]
    assert {"$.error.Error", "$.notify_error.Error", "$$.Execution.Id"} <= set(re.findall(r"\$\$?[.\w]+", message))
    assert "Cause" not in message
    assert (publish["Next"], [c["Next"] for c in publish["Catch"]]) == ("Refused", ["Refused"])
    assert states["Refused"]["Type"] == "Fail"


def test_a_record_that_wrote_then_failed_ends_as_record_failed_not_as_nothing_opened() -> None:
    states = load("incident")["States"]
    # The fail handler answers the incident it recorded FAILED (None when the alarm opened nothing),
    refused = states["AlarmRefused"]
    assert (refused["ResultSelector"], refused["ResultPath"]) == ({"incident_id.$": "$.Payload.incident_id"}, "$.ended")
    assert refused["Next"] == "WasAnythingOpened"
    # and only an alarm that opened nothing ends as refused.
    opened = states["WasAnythingOpened"]
    assert opened["Type"] == "Choice"
    assert opened["Choices"] == [{"Variable": "$.ended.incident_id", "IsNull": True, "Next": "Refused"}]
    assert opened["Default"] == "RecordFailed"
    assert (states["RecordFailed"]["Type"], states["RecordFailed"]["Error"]) == ("Fail", "RecordFailed")


def test_record_is_told_its_execution_and_a_mismatching_suspect_stops_for_attention() -> None:
    states = load("incident")["States"]
    assert states["Record"]["Parameters"]["Payload"] == {"event.$": "$", "execution_id.$": "$$.Execution.Id"}
    to_attention = {e for c in states["Resolve"]["Catch"] if c["Next"] == "NeedsAttention" for e in c["ErrorEquals"]}
    assert {"SuspectMismatch", "SuspectNotOperatorPod", "SuspectUnresolvable", "NotInCluster"} <= to_attention
    assert "TransientKubernetesError" in {e for r in states["Resolve"]["Retry"] for e in r["ErrorEquals"]}
    assert "LockLost" in {e for r in states["Guard"]["Retry"] for e in r["ErrorEquals"]}


def test_the_decision_carries_the_decide_execution() -> None:
    decide = load("decide")["States"]["Decide"]
    assert decide["Parameters"]["Payload"]["execution_arn.$"] == "$$.Execution.Id"
    assert decide["ResultSelector"]["execution_arn.$"] == "$.Payload.execution_arn"


# -- the node checks (issue 26): reproduce on the suspect, qualify every replacement -----------------------


def successors(state: dict[str, Any]) -> set[str]:
    nexts = {state.get("Next"), state.get("Default")} | {c["Next"] for c in state.get("Choices", []) + state.get("Catch", [])}
    return {n for n in nexts if n}


def test_the_reproduction_runs_after_the_cordon_and_never_keeps_the_reviewers_from_deciding() -> None:
    states = load("incident")["States"]
    assert states["CordonNodes"]["Next"] == "StartReproduce"
    # Every way out of the reproduction (done, out of polls, any error, nothing started) leads to the evidence.
    for name in REPRODUCE:
        assert successors(states[name]) <= {*REPRODUCE, "CollectEvidence"}, name
    for name in ("StartReproduce", "CheckReproduce"):
        state = states[name]
        assert state["Parameters"]["Payload"]["purpose"] == "reproduce"
        assert [c["ErrorEquals"] for c in state["Catch"]] == [["States.ALL"]], name
        assert state["ResultPath"] == "$.reproduce"  # the incident's own data (incident_id, timeouts, ...) is kept
    done = {c["Variable"]: c["Next"] for c in states["ReproduceDone"]["Choices"]}
    assert done == {"$.reproduce.done": "CollectEvidence", "$.reproduce.exhausted": "CollectEvidence"}
    assert states["ReproduceDone"]["Default"] == "WaitReproduce"
    assert states["WaitReproduce"]["SecondsPath"] == "$.timeouts.node_check_poll_seconds"
    # Only the reproduction reaches the evidence from the cordon.
    assert {n for n, s in states.items() if "CollectEvidence" in successors(s)} == {"StartReproduce", "CheckReproduce", "ReproduceDone"}


def _reaches(states: dict[str, Any], start: str, goal: str, avoiding: set[str]) -> bool:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name == goal:
            return True
        if name in seen or name in avoiding:
            continue
        seen.add(name)
        todo.extend(successors(states[name]))
    return False


def test_the_job_resumes_only_onto_replacements_that_qualified() -> None:
    states = load("incident")["States"]
    # The pointer is rewritten (and the job resumed) only from the qualification's verdict: true, or null (no capsule).
    assert {n for n, s in states.items() if "RewritePointer" in successors(s)} == {"Qualified"}
    assert {n for n, s in states.items() if "ResumeJob" in successors(s)} == {"RewritePointer"}
    verdict = states["Qualified"]
    to_pointer = [c for c in verdict["Choices"] if c["Next"] == "RewritePointer"]
    assert [(c["Variable"], c.get("IsNull"), c.get("BooleanEquals")) for c in to_pointer] == [
        ("$.qualify.qualified", True, None),
        ("$.qualify.qualified", None, True),
    ]
    assert verdict["Default"] != "RewritePointer"
    # No path from the replacement to the pointer avoids the qualification's check.
    assert not _reaches(states, "ReplaceNodes", "RewritePointer", avoiding={"CheckQualify"})
    assert not _reaches(states, "ReplaceUnqualified", "RewritePointer", avoiding={"CheckQualify"})
    # A qualification that cannot finish stops for attention: errors, out of polls, no further round allowed.
    for name in ("StartQualify", "CheckQualify", "RejectReplacement"):
        assert [(c["ErrorEquals"], c["Next"]) for c in states[name]["Catch"]] == [(["States.ALL"], "NeedsAttention")], name
    done = {c["Variable"]: c["Next"] for c in states["QualifyDone"]["Choices"]}
    assert done["$.qualify.done"] == "Qualified"
    assert states[done["$.qualify.exhausted"]]["Next"] == "NeedsAttention"
    assert states["WaitQualify"]["SecondsPath"] == "$.timeouts.node_check_poll_seconds"
    for name in ("StartQualify", "CheckQualify"):
        assert states[name]["Parameters"]["Payload"]["purpose"] == "qualify"
    again = states["ReplaceAgain"]
    assert [(c["Variable"], c["Next"]) for c in again["Choices"]] == [("$.rejected.replace_again", "ReplaceUnqualified")]
    assert states[again["Default"]]["Next"] == "NeedsAttention"
    assert states[again["Default"]]["Parameters"]["Cause.$"] == "$.rejected.reason"  # the reviewers read why


def test_a_new_node_that_fails_is_replaced_again_by_the_replace_function_and_waited_for() -> None:
    states = load("incident")["States"]
    first, again = states["ReplaceNodes"], states["ReplaceUnqualified"]
    assert again["Type"] == "Map"
    assert again["ItemsPath"] == "$.rejected.instance_ids"
    assert again["ItemSelector"] == first["ItemSelector"]
    (inner,) = again["ItemProcessor"]["States"].values()
    (replace,) = first["ItemProcessor"]["States"].values()
    assert inner["Parameters"] == replace["Parameters"] == {"FunctionName": "${ReplaceFunctionArn}", "Payload.$": "$"}
    assert inner["Retry"] == replace["Retry"]
    assert again["Catch"] == first["Catch"]
    assert again["Next"] == first["Next"] == "StartPolling"


def test_every_result_selector_reads_fields_its_handler_returns() -> None:
    from sdcguard.lambdas import outputs

    returns: dict[str, type[outputs.Output]] = {
        "${RecordFunctionArn}": outputs.Recorded, "${ResolveFunctionArn}": outputs.Resolved,
        "${GuardFunctionArn}": outputs.Guarded, "${CordonFunctionArn}": outputs.Cordoned,
        "${EvidenceFunctionArn}": outputs.Evidence, "${ReplaceFunctionArn}": outputs.ReplacementRequested,
        "${ReplacementStatusFunctionArn}": outputs.ReplacementPoll,
        "${StartNodeCheckFunctionArn}": outputs.NodeChecksStarted,
        "${NodeCheckStatusFunctionArn}": outputs.NodeCheckPoll,
        "${RejectReplacementFunctionArn}": outputs.ReplacementRejected,
        "${DecideFunctionArn}": outputs.Decided, "${FailFunctionArn}": outputs.Ended,
    }  # fmt: skip
    checked = set()
    for name in MACHINES:
        for state_name, state in all_states(load(name)):
            selector = state.get("ResultSelector")
            if not selector:
                continue
            function = state["Parameters"]["FunctionName"]
            fields = {path.removeprefix("$.Payload.") for path in selector.values()}
            returned = set(returns[function].model_fields)
            assert fields <= returned, (state_name, fields - returned)
            checked.add(function)
    assert {"${StartNodeCheckFunctionArn}", "${NodeCheckStatusFunctionArn}", "${RejectReplacementFunctionArn}"} <= checked
