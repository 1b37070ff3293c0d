"""What the drill reads from the ledger's node checks and how it judges them against the fault it injected."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from sdcguard.contract import Alarm, Incident, NodeCheck
from sdcguard.infra.drill import node_checks
from sdcguard.infra.drill.summary import DrillSummary, NodeCheckRow
from tests.events import load_event

ALARM_AT = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)
SUSPECT, NEW, NEWER = "hyperpod-i-0123456789abcdef0", "hyperpod-i-0fedcba9876543210", "hyperpod-i-0aaaaaaaaaaaaaaaa"


def _row(purpose: str, node: str, state: str, *, reproduced: int = 0, summary: str = "", at: float = 5.0,
         repeats: int = 5) -> NodeCheckRow:
    return NodeCheckRow(purpose=purpose, node=node, state=state, repeats=repeats, reproduced=reproduced,
                        matched=repeats - reproduced, summary=summary, seconds_after_alarm=at)


def test_rows_are_the_ledger_checks_with_their_finish_in_seconds_after_the_alarm() -> None:
    check = NodeCheck(purpose="reproduce", node=SUSPECT, instance_id="i-0123456789abcdef0", job="sdcguard-reproduce-x",
                      repeats=5, state="failed", reproduced=5, summary="reproduced 5/5: persistent",
                      started_at=ALARM_AT + timedelta(seconds=3), finished_at=ALARM_AT + timedelta(seconds=7.5))

    incident = Incident(incident_id="inc-00000001", idempotency_key="k",
                        alarm=Alarm.model_validate(load_event("alarm_ring_audit")["detail"]), node_checks=[check])

    (row,) = node_checks.rows(incident, ALARM_AT.timestamp())

    assert (row.purpose, row.node, row.state, row.seconds_after_alarm) == ("reproduce", SUSPECT, "failed", 7.5)
    assert node_checks.reproduction([row], SUSPECT) == node_checks.Reproduction("5/5", "reproduced 5/5: persistent")


def test_the_reproduction_is_k_of_n_when_it_ran_and_null_with_why_when_it_did_not() -> None:
    passed = _row("reproduce", SUSPECT, "passed", summary="reproduced 0/5")
    skipped = _row("reproduce", SUSPECT, "skipped", summary="not run: no capsule for rank 3", repeats=0)
    inconclusive = _row("reproduce", SUSPECT, "inconclusive", summary="inconclusive: deadline")

    assert node_checks.reproduction([passed], SUSPECT).reproduced == "0/5"
    assert node_checks.reproduction([skipped], SUSPECT) == node_checks.Reproduction(
        None, "not run: no capsule for rank 3")
    assert node_checks.reproduction([inconclusive], SUSPECT).reproduced is None
    # a check on another node says nothing about the suspect
    assert node_checks.reproduction([_row("reproduce", NEW, "failed", reproduced=5)], SUSPECT).reproduced is None


@pytest.mark.parametrize(
    ("result", "persistent", "capsule", "problem"),
    [
        (node_checks.Reproduction("5/5", "reproduced 5/5: persistent"), True, True, None),
        (node_checks.Reproduction("2/5", "reproduced 2/5: intermittent"), True, True, "not every time"),
        (node_checks.Reproduction("0/5", "reproduced 0/5"), True, True, "not every time"),
        (node_checks.Reproduction(None, "not run: no capsule"), True, True, "was not replayed on its node"),
        (node_checks.Reproduction(None, "not run: no capsule"), False, False, None),
        (node_checks.Reproduction("0/5", "reproduced 0/5"), False, False, "leaves no capsule"),
    ],
)
def test_a_reproduction_that_contradicts_the_injected_fault_is_a_problem(
        result: node_checks.Reproduction, persistent: bool, capsule: bool, problem: str | None) -> None:
    said = node_checks.reproduction_problem(result, persistent=persistent, leaves_capsule=capsule)
    assert (said is None) if problem is None else (problem in (said or ""))


def test_qualification_is_one_answer_for_one_new_node_and_a_list_for_several() -> None:
    healthy = _row("qualify", NEW, "passed", summary=f"qualified 5/5 on {NEW}")
    faulty = _row("qualify", NEW, "failed", reproduced=5, summary=f"failed 0/5 on {NEW}")
    faulty_again = _row("qualify", NEWER, "failed", reproduced=5, at=20.0)
    suspect = _row("reproduce", SUSPECT, "failed", reproduced=5)

    assert node_checks.qualification([suspect, healthy]).qualified is True
    assert node_checks.qualification([suspect, faulty]).qualified is False
    both = node_checks.qualification([suspect, faulty, faulty_again])
    assert both.qualified == [False, False]
    assert both.line == f"{NEW}: failed 0/5 on {NEW}; {NEWER}: failed"
    assert node_checks.unqualified_nodes([suspect, faulty, faulty_again]) == [NEW, NEWER]
    assert node_checks.qualification([suspect]) == node_checks.Qualification(
        None, "not qualified: the incident recorded no qualification")
    skipped = _row("qualify", NEW, "skipped", summary="not qualified: no capsule", repeats=0)
    assert node_checks.qualification([skipped]).qualified is None
    assert node_checks.unqualified_nodes([skipped]) == []  # not run is not failed: the pipeline says so
    assert node_checks.finished_at([suspect, faulty, faulty_again], "qualify") == 20.0


def test_the_summary_records_both_node_checks_in_its_json() -> None:
    summary = DrillSummary(suspect_reproduced=None, suspect_reproduction="not run: no capsule",
                           replacement_qualified=[False, True],
                           node_checks=[_row("reproduce", SUSPECT, "skipped", repeats=0)])

    written = summary.as_json()

    assert written["suspect_reproduced"] is None
    assert written["suspect_reproduction"] == "not run: no capsule"
    assert written["replacement_qualified"] == [False, True]
    assert written["node_checks"][0]["state"] == "skipped"
    notes = node_checks.timeline_notes(summary.node_checks or [])
    assert notes == {"reproduced": f"reproduction on {SUSPECT}: skipped"}
