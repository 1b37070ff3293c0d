"""An operator cannot resume a job into the suspect window: aborting or releasing an incident a reviewer
approved, whose resume pointer was never rewritten, leaves the job suspended, or resumes it from a verified
checkpoint before the suspect window the operator names, and says which."""

from __future__ import annotations

import copy

import pytest
from kubernetes import client as k8s

from sdcguard.commands.incidents import job_outcome, next_steps
from sdcguard.contract import Alarm, IncidentState, ResolvedSuspect, RollbackPlan
from sdcguard.contract.checkpoint import checkpoint_dir
from sdcguard.lambdas.abort import Resume, abort_incident, release_stopped
from sdcguard.lambdas.cordon import cordon_node
from sdcguard.lambdas.errors import UnsafeResume
from sdcguard.lambdas.job import holders, suspend_job
from sdcguard.lineage.pointer import read_pointer
from sdcguard.lineage.pointer import rewrite_pointer as point_at
from sdcguard.lineage.store import open_store
from tests.functional.test_handlers_pipeline import (
    World,
    alarm_event,
    fresh_node,
    moved_to,
    our_taints,
    private_ledger,
    read_job,
    read_node,
    resolved_to,
    world,
    write_checkpoints,
)

__all__ = ["world"]  # the fixture, shared with the pipeline's handler tests
S = IncidentState
CLEAN = 7000
"""Every incident here: the same suspect window (the ring audit clean through this step), on its own node."""


def _approved(world: World, ledger: object, node: str, *, then: list[IncidentState]) -> str:
    """An incident of this world's job that suspended it, cordoned ``node``, was approved, then went ``then``."""
    from sdcguard.lambdas.ledger import Ledger

    assert isinstance(ledger, Ledger)
    detail = copy.deepcopy(alarm_event(world, 0, ring_clean=CLEAN)["detail"])
    detail["suspects"][0]["node"] = node
    incident, _ = ledger.open(Alarm.model_validate(detail), mode="normal")
    iid = incident.incident_id
    ledger.update(iid, resolved_to(ResolvedSuspect(global_rank=3, pod="p", node=node,
                                                   instance_id=node.removeprefix("hyperpod-"))))
    suspend_job(world.kube(), world.seeded["namespace"], world.seeded["job"], iid)
    cordon_node(world.kube(), node, iid)
    trusted = incident.alarm.trusted_through_step()
    plan = RollbackPlan(pointer_from=None, to=checkpoint_dir(trusted - 10), to_step=trusted - 10,
                        alarm_step=incident.alarm.step)
    for state in (S.GUARDED, S.SUSPENDED, S.CORDONED, S.EVIDENCE_COLLECTED, S.AWAITING_APPROVAL):
        ledger.update(iid, moved_to(state))
    ledger.update(iid, lambda i: i.model_copy(update={"rollback": plan}))
    for state in (S.APPROVED, *then):
        ledger.update(iid, moved_to(state))
    return iid


def _run_job(world: World) -> None:
    """The job running, held by nobody (what a person's ``kubectl patch`` does)."""
    k8s.CustomObjectsApi(world.kube()).patch_namespaced_custom_object(
        "kubeflow.org", "v1", world.seeded["namespace"], "pytorchjobs", world.seeded["job"],
        {"metadata": {"annotations": {"sdcguard.io/suspended-by": None}}, "spec": {"runPolicy": {"suspend": False}}})


def _suspended(world: World) -> bool:
    return bool(read_job(world)["spec"]["runPolicy"].get("suspend"))


def test_abort_or_release_of_an_approved_incident_never_resumes_into_the_suspect_window(world: World) -> None:
    # Given a running job whose pointer names a checkpoint inside the suspect window (the rewrite never ran)
    ledger = private_ledger(world)
    _run_job(world)
    replacing = _approved(world, ledger, fresh_node(world), then=[S.REPLACING])
    trusted = ledger.get(replacing).alarm.trusted_through_step()
    write_checkpoints(world, [trusted - 10, trusted + 20])
    store = open_store(f"s3://{world.seeded['bucket']}/{world.seeded['job']}", client=world.standin.client("s3"))
    point_at(store, trusted_through_step=trusted + 20, reason="the job's own latest", written_by="agent")
    s3 = world.standin.client("s3")

    # (`incidents show` says what ending it does and how to resume instead)
    assert any(f"--resume-from a checkpoint at or before step {trusted}" in line
               for line in next_steps(ledger.get(replacing)))
    # When an operator aborts the replacing incident without saying where to resume from
    node = ledger.get(replacing).suspects[0].node
    aborted = abort_incident(ledger, world.kube, replacing, operator="oncall", reason="stuck", sfn=None, s3=s3)
    # Then the job stays suspended (nothing holds it: a person resumes it), the pointer is untouched, and it says so
    assert aborted.state == S.ABORTED
    assert _suspended(world)
    assert replacing not in holders(read_job(world))
    assert read_pointer(store)[0].step == trusted + 20  # type: ignore[union-attr]
    assert "stays suspended" in aborted.transitions[-1].note
    assert f"at or before step {trusted}" in job_outcome(aborted)
    assert our_taints(read_node(world, node)) == []  # what it cordoned is freed as before

    # Given the job resumed by a person, then an approved incident whose replacement did not qualify
    _run_job(world)
    unqualified = _approved(world, ledger, fresh_node(world), then=[S.REPLACING, S.NEEDS_ATTENTION])
    # When the operator names a checkpoint in the suspect window, or one that does not exist
    for bad, why in ((checkpoint_dir(trusted + 20), "inside the suspect window"), ("12", "incomplete, no MANIFEST.json")):
        with pytest.raises(UnsafeResume, match=why):
            release_stopped(ledger, world.kube, unqualified, operator="oncall", reason="r", resume=Resume(bad), s3=s3)
    # Then nothing changed
    assert ledger.get(unqualified).state == S.NEEDS_ATTENTION
    assert unqualified in holders(read_job(world))
    # When it names a verified one before the window
    released = release_stopped(ledger, world.kube, unqualified, operator="oncall", reason="looked at it",
                               resume=Resume(str(trusted - 10)), s3=s3)
    # Then the pointer names it, the job resumes from it, and the ledger and the command say so
    assert read_pointer(store)[0].step == trusted - 10  # type: ignore[union-attr]
    assert not _suspended(world)
    assert (released.state, released.checkpoint_after, released.resumed_from_step) == (
        S.RELEASED, checkpoint_dir(trusted - 10), trusted - 10)
    assert f"from {checkpoint_dir(trusted - 10)} (step {trusted - 10}), before the suspect window" in job_outcome(released)
