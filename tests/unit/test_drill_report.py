"""The drill's typed summary, its chaos tally and what the report prints from them (no stand-in needed)."""

from __future__ import annotations

from typing import Any

from sdcguard.infra.drill.chaos import state_retries, summary_of
from sdcguard.infra.drill.report import chaos_lines, verdict_lines
from sdcguard.infra.drill.summary import DrillSummary, NodeCheckRow, ReplacementRow
from sdcguard.infra.local.eks.faults import ChaosTally


def _entered(name: str) -> dict[str, Any]:
    return {"type": "TaskStateEntered", "stateEnteredEventDetails": {"name": name}}


def _failed(error: str) -> dict[str, Any]:
    return {"type": "TaskFailed", "taskFailedEventDetails": {"error": error, "cause": "..."}}


SCHEDULED = {"type": "TaskScheduled"}
SUCCEEDED = {"type": "TaskSucceeded"}

# Record ran once; SuspendJob failed once and was retried; the Map's Cordon failed twice, then passed;
# Close failed for good (caught: no retry followed it).
HISTORY = [
    _entered("Record"), SCHEDULED, SUCCEEDED,
    _entered("SuspendJob"), SCHEDULED, _failed("TransientKubernetesError"), SCHEDULED, SUCCEEDED,
    {"type": "MapStateEntered", "stateEnteredEventDetails": {"name": "CordonNodes"}},
    _entered("Cordon"), SCHEDULED, _failed("TransientKubernetesError"), SCHEDULED,
    _failed("Lambda.TooManyRequestsException"), SCHEDULED, SUCCEEDED,
    _entered("Close"), SCHEDULED, _failed("IncidentNotWaiting"),
]


def test_state_retries_are_the_invocations_beyond_one_per_entry_and_name_what_they_absorbed() -> None:
    retries, errors = state_retries(HISTORY)

    assert dict(retries) == {"SuspendJob": 1, "Cordon": 2}
    assert dict(errors) == {
        "SuspendJob: TransientKubernetesError": 1,
        "Cordon: TransientKubernetesError": 1,
        "Cordon: Lambda.TooManyRequestsException": 1,
    }


def test_the_chaos_summary_adds_up_both_sides_and_prints_what_absorbed_the_faults() -> None:
    tallies = {
        "kubernetes": ChaosTally(injected={"PATCH nodes": {503: 1}, "GET pytorchjobs": {429: 2}},
                                 retried={"PATCH nodes": 1, "GET pytorchjobs": 2}),
        "hyperpod": ChaosTally(injected={"ListClusterNodes": {500: 1}}, outstanding={"ListClusterNodes": 1}),
    }

    chaos = summary_of(tallies, 0.2, 12, HISTORY, incidents_opened=1)

    assert (chaos.faults_injected, chaos.retries_absorbed, chaos.not_retried) == (4, 3, 1)
    assert chaos.by_call["kubernetes GET pytorchjobs"].injected == {"429": 2}
    assert chaos.by_call["hyperpod ListClusterNodes"].retried == 0
    assert chaos.state_retries == {"Cordon": 2, "SuspendJob": 1}
    lines = chaos_lines(chaos)
    assert lines[0] == ("4 faults injected at rate 0.2 (seed 12): kubernetes GET pytorchjobs 2, "
                        "kubernetes PATCH nodes 1, hyperpod ListClusterNodes 1")
    assert lines[1] == "3 absorbed by a retry of the same call, 1 not retried; 1 incident(s) opened"
    assert lines[2].startswith("state retries (execution history): Cordon 2, SuspendJob 1 (")


def test_the_summary_holds_only_what_the_stages_learned() -> None:
    # A drill that failed at detection says nothing of a replacement or a pointer, not even null;
    failed = DrillSummary(fault="nan_activation", drill_seconds={"faulty_run": 3.0}, pointer_before=None)
    failed.verdict = "FAILED"
    failed.failed_step = "detection"

    assert failed.as_json() == {"fault": "nan_activation", "drill_seconds": {"faulty_run": 3.0},
                                "pointer_before": None, "verdict": "FAILED", "failed_step": "detection"}
    assert verdict_lines(failed, "detection", "no alarm")[-2:] == ["verdict: FAILED at detection: no alarm",
                                                                    "report: -"]


def test_a_passed_summary_prints_the_verdict_line_of_the_drill() -> None:
    passed = DrillSummary(
        fault="finite_activation", fault_rank=3, fault_step=33, detector="ring_audit", alarm_step=40,
        suspect_instances=["i-0123456789abcdef0"], localized_correctly=True, incident_state="CLOSED",
        resumed_from_step=30, decision="approve", recovered_bit_exact=True, report_dir="/r",
        replacements=[ReplacementRow(old="i-0123456789abcdef0", new="i-0fedcba9876543210", status="Running")],
        phase_seconds={"alarm": 0.0, "cordon": 7.5, "reproduced": 9.25, "approval": None, "replaced": None,
                       "qualified": None, "resumed": None},
        node_checks=[NodeCheckRow(purpose="reproduce", node="hyperpod-i-0123456789abcdef0", state="failed",
                                  repeats=5, reproduced=5, summary="reproduced 5/5: persistent",
                                  seconds_after_alarm=9.25)],
        suspect_reproduced="5/5", replacement_qualified=True,
        drill_seconds={"clean_run": 10.25},
    )

    lines = verdict_lines(passed, None, None)

    assert lines[:4] == ["[7/7] timeline (seconds after the alarm):", "  alarm      +   0.00 s   (+  0.00 s)",
                         "  cordon     +   7.50 s   (+  7.50 s)",
                         "  reproduced +   9.25 s   (+  1.75 s)   reproduction on hyperpod-i-0123456789abcdef0: "
                         "reproduced 5/5: persistent"]
    assert "  drill     clean_run 10.2 s" in lines
    assert lines[-2] == (
        "verdict: PASSED  fault finite_activation on rank 3 at step 33 -> ring_audit alarm at step 40, suspects "
        "['i-0123456789abcdef0'] (localized correctly: True); reproduced on the suspect 5/5; replacement "
        "qualified: true; incident CLOSED; resumed from step 30; recovered bit-exact: true")
    assert passed.as_json()["replacements"] == [{"old": "i-0123456789abcdef0", "new": "i-0fedcba9876543210",
                                                 "status": "Running"}]
    assert (passed.as_json()["suspect_reproduced"], passed.as_json()["replacement_qualified"]) == ("5/5", True)


def test_a_drill_that_kept_the_job_off_a_faulty_replacement_says_so_in_its_verdict() -> None:
    # Given --replacement-faulty: both replacements failed their qualification and the incident stopped,
    held = DrillSummary(
        fault="finite_activation", fault_rank=3, fault_step=33, detector="magnitude_trigger", alarm_step=33,
        suspect_instances=["i-0123456789abcdef0"], localized_correctly=True, incident_state="NEEDS_ATTENTION",
        decision="approve", replacement_faulty=True, suspect_reproduced="5/5",
        replacement_qualified=[False, False], resumed_onto_unqualified=False,
        replacement_outcome="NEEDS_ATTENTION: hyperpod-i-2 failed qualification and is cordoned; hyperpod-i-1 "
                            "failed it too and was replaced; the job stays suspended",
        node_checks=[NodeCheckRow(purpose="qualify", node=f"hyperpod-i-{n}", state="failed", repeats=5,
                                  reproduced=5, summary=f"failed 0/5 on hyperpod-i-{n}") for n in (1, 2)],
        phase_seconds={"alarm": 0.0, "qualified": 20.0},
    )

    lines = verdict_lines(held, None, None)

    # the timeline names each new node's qualification, and the verdict says the job was not resumed.
    assert ("  qualified  +  20.00 s   (+ 20.00 s)   qualification of hyperpod-i-1: failed (failed 0/5 on "
            "hyperpod-i-1); qualification of hyperpod-i-2: failed (failed 0/5 on hyperpod-i-2)") in lines
    assert lines[-2].endswith(
        "replacement qualified: [false, false]; incident NEEDS_ATTENTION; not resumed onto an unqualified node: "
        "NEEDS_ATTENTION: hyperpod-i-2 failed qualification and is cordoned; hyperpod-i-1 failed it too and was "
        "replaced; the job stays suspended")
    written = held.as_json()
    assert (written["replacement_faulty"], written["resumed_onto_unqualified"]) == (True, False)
    assert "recovered_bit_exact" not in written
