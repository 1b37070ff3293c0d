"""One cordon holder per incident, and a decide retry that delivers: two incidents on one node each hold it
(the first one's release leaves it cordoned for the second), and the decide function retried after it wrote
its decision but before it answered the token delivers that decision instead of reporting "nothing changed"."""

from __future__ import annotations

import copy
import json

from sdcguard.contract import Alarm, Decision, IncidentState, ResolvedSuspect
from sdcguard.lambdas.abort import abort_incident
from sdcguard.lambdas.cordon import ANNOTATION_HELD_BY, cordon_node
from sdcguard.lambdas.decide import note_decision
from sdcguard.lambdas.handlers import decide
from sdcguard.lambdas.job import suspend_job
from sdcguard.lambdas.ledger import Ledger
from tests.functional.test_handlers_pipeline import (
    CTX,
    World,
    alarm_event,
    decision_of,
    fresh_node,
    moved_to,
    our_taints,
    private_ledger,
    read_node,
    resolved_to,
    wait_for_end,
    waiting_with_real_token,
    world,
)

__all__ = ["world"]  # the fixture, shared with the pipeline's handler tests
S = IncidentState


def _cordoned(world: World, ledger: Ledger, node: str) -> str:
    """An open incident of this world's job (in a window of its own) that suspended the job and cordoned ``node``."""
    detail = copy.deepcopy(alarm_event(world, 0)["detail"])
    detail["suspects"][0]["node"] = node
    incident, _ = ledger.open(Alarm.model_validate(detail), mode="normal")
    iid = incident.incident_id
    ledger.update(iid, resolved_to(ResolvedSuspect(global_rank=3, pod="p", node=node,
                                                   instance_id=node.removeprefix("hyperpod-"))))
    suspend_job(world.kube(), world.seeded["namespace"], world.seeded["job"], iid)
    cordon_node(world.kube(), node, iid)
    for state in (S.GUARDED, S.SUSPENDED, S.CORDONED):
        ledger.update(iid, moved_to(state))
    return iid


def test_a_node_two_incidents_hold_goes_back_into_service_only_when_both_ended(world: World) -> None:
    # Given two open incidents that cordoned the same node
    ledger = private_ledger(world)
    node = fresh_node(world)
    first, second = _cordoned(world, ledger, node), _cordoned(world, ledger, node)
    assert read_node(world, node).metadata.annotations[ANNOTATION_HELD_BY] == f"{first},{second}"
    # When the first is aborted
    abort_incident(ledger, world.kube, first, operator="oncall", reason="one of two", sfn=None)
    # Then the node stays cordoned, held by the second alone
    held = read_node(world, node)
    assert held.spec.unschedulable is True
    assert [t.value for t in our_taints(held)] == [second]
    assert ANNOTATION_HELD_BY not in held.metadata.annotations  # one holder: the taint names it
    # When the second ends too, the node is back in service
    abort_incident(ledger, world.kube, second, operator="oncall", reason="the other", sfn=None)
    freed = read_node(world, node)
    assert freed.spec.unschedulable in (None, False)
    assert our_taints(freed) == []
    assert ANNOTATION_HELD_BY not in (freed.metadata.annotations or {})


def test_a_decide_retry_after_its_write_delivers_the_decision(world: World) -> None:
    # Given an incident waiting with a live token, and a decide execution whose first attempt wrote its
    # decision to the ledger, then stopped before it answered the token (a crash, a timeout)
    incident_id, execution = waiting_with_real_token(world)
    request = decision_of(world, incident_id, "approve", "Xid 79 on GPU 1", "arn:aws:iam::123456789012:user/oncall")
    written = Decision(decision="approve", reviewer=request["reviewer"], reason=request["reason"],
                       execution_arn=request["execution_arn"])
    world.ledger.update(incident_id, lambda i: note_decision(i, written))
    assert world.tokens.get(incident_id) is not None
    # When the decide function is retried with the same input
    result = decide.handler(request, CTX)
    # Then the decision is delivered (the incident machine goes on with it) and adopted, as first written
    assert result["state"] == "APPROVED"
    ended = wait_for_end(world, execution)
    assert (ended["status"], json.loads(ended["output"])["decision"]) == ("SUCCEEDED", "approve")
    incident = world.ledger.get(incident_id)
    assert incident.decision == written
    assert world.tokens.get(incident_id) is None
