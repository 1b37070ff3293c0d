"""The pipeline's pure logic: resolution, dedup keys, blast radius, evidence verdicts, inputs, settings."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sdcguard.contract import Alarm, Incident, IncidentState, ResolvedSuspect, Transition
from sdcguard.lambdas.approval import approval_message
from sdcguard.lambdas.errors import MalformedEvent, NotInCluster, StaleAlarm, SuspectUnresolvable
from sdcguard.lambdas.evidence import (
    CORROBORATED,
    NO_HARDWARE_SIGNAL,
    MetricSeries,
    confirmed_incidents_of,
    prior_incidents_of,
    verdict_for,
)
from sdcguard.lambdas.guard import check_blast_radius, quarantined_nodes
from sdcguard.lambdas.inputs import AlarmEvent, InstanceRef, parse_input
from sdcguard.lambdas.job import holders
from sdcguard.lambdas.ledger import FOREVER, Ledger, counts_until, idempotency_key, incident_id_for
from sdcguard.lambdas.notify import describe
from sdcguard.lambdas.pointer import allowed_prefix
from sdcguard.lambdas.record import check_job, check_scope
from sdcguard.lambdas.replace import find_successors
from sdcguard.lambdas.resolve import (
    ClusterNode,
    Observed,
    check_fresh,
    instance_id_from_node_name,
    mismatch,
    resolve_suspects,
    stale,
)
from sdcguard.lambdas.settings import Settings, SettingsError
from tests.events import load_event

I1, I2, I3 = "i-0123456789abcdef0", "i-0223456789abcdef0", "i-0323456789abcdef0"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def alarm(name: str, **changes: Any) -> Alarm:
    detail = copy.deepcopy(load_event(name)["detail"])
    detail.update(changes)
    return Alarm.model_validate(detail)


def cluster(*ids: str, group: str = "workers") -> dict[str, ClusterNode]:
    return {
        i: ClusterNode(instance_id=i, instance_group=group, status="Running", private_dns=f"ip-10-1-35-{n}.ec2.internal")
        for n, i in enumerate(ids, start=101)
    }


def incident(
    name: str, state: IncidentState, nodes: list[tuple[str, str]], *, entered: dict[IncidentState, datetime] | None = None
) -> Incident:
    a = alarm(name)
    suspects = [ResolvedSuspect(global_rank=r, pod=f"p{r}", node=f"hyperpod-{i}", instance_id=i) for r, (i, _) in enumerate(nodes)]
    transitions = [Transition(state=s, at=t, actor="test") for s, t in (entered or {}).items()]
    key = f"{name}|{nodes}"
    return Incident(
        incident_id=incident_id_for(key), idempotency_key=key, alarm=a, state=state, suspects=suspects, transitions=transitions
    )


# -- resolution -------------------------------------------------------------------


def test_node_names_carry_the_instance_id() -> None:
    assert instance_id_from_node_name("hyperpod-i-0123456789abcdef0") == I1
    assert instance_id_from_node_name("hyperpod-i-01234567") == "i-01234567"
    assert instance_id_from_node_name("ip-10-1-35-101.ec2.internal") is None
    assert instance_id_from_node_name("hyperpod-i-0123456789ABCDEF0") is None
    assert instance_id_from_node_name("xhyperpod-i-0123456789abcdef0") is None


def test_resolution_maps_each_rank_to_its_instance() -> None:
    resolved = resolve_suspects(alarm("alarm_two_nodes"), cluster(I1, I2, I3))
    assert [(s.global_rank, s.instance_id, s.instance_group) for s in resolved] == [(2, I1, "workers"), (4, I2, "workers")]


def test_a_renamed_node_resolves_through_the_cluster_node_list() -> None:
    nodes = cluster(I2, I3)  # I2 gets ip-10-1-35-101, I3 ip-10-1-35-102
    nodes = {I3: nodes[I3], I1: ClusterNode(I1, "workers", "Running", private_dns="ip-10-1-35-103.ec2.internal")}
    resolved = resolve_suspects(alarm("alarm_renamed_node"), nodes)
    assert [s.instance_id for s in resolved] == [I1]


def test_an_instance_outside_the_cluster_is_refused() -> None:
    with pytest.raises(NotInCluster, match=I2):
        resolve_suspects(alarm("alarm_two_nodes"), cluster(I1, I3))


def test_an_untraceable_node_is_refused() -> None:
    with pytest.raises(SuspectUnresolvable, match="rank 3"):
        resolve_suspects(alarm("alarm_renamed_node"), cluster(I2, I3))


def test_an_unlocalised_alarm_names_nothing_to_act_on() -> None:
    with pytest.raises(SuspectUnresolvable, match="not localised"):
        resolve_suspects(alarm("alarm_unlocalized"), cluster(I1, I2, I3))


# -- dedup keys -------------------------------------------------------------------


def test_the_same_fault_from_another_rank_or_redelivered_is_one_incident() -> None:
    first = alarm("alarm_ring_audit")
    from_rank_5 = alarm("alarm_ring_audit", alarm_id="ffff0000ffff0001", publisher_rank=5, message="again")
    later_step = alarm("alarm_ring_audit", step=201)
    assert idempotency_key(first) == idempotency_key(from_rank_5) == idempotency_key(later_step)
    assert incident_id_for(idempotency_key(first)) == incident_id_for(idempotency_key(from_rank_5))


def test_several_detectors_on_one_fault_share_the_suspect_window() -> None:
    ring = alarm("alarm_ring_audit")
    weights = Alarm.model_validate(
        {
            **load_event("alarm_weight_fingerprint")["detail"],
            "suspects": load_event("alarm_ring_audit")["detail"]["suspects"],
            "last_clean": {"ring_audit": 100, "weight_fingerprint": 190},
            "step": 200,
        }
    )
    assert idempotency_key(ring) == idempotency_key(weights)


def test_other_nodes_jobs_or_windows_are_other_incidents() -> None:
    base = idempotency_key(alarm("alarm_ring_audit"))
    other_node = alarm("alarm_ring_audit", suspects=[{**load_event("alarm_ring_audit")["detail"]["suspects"][0], "node": f"hyperpod-{I2}"}])
    other_job = alarm("alarm_ring_audit", job={**load_event("alarm_ring_audit")["detail"]["job"], "job_name": "other"})
    other_window = alarm("alarm_ring_audit", last_clean={"ring_audit": 300, "weight_fingerprint": 300})
    keys = {base, idempotency_key(other_node), idempotency_key(other_job), idempotency_key(other_window)}
    assert len(keys) == 4
    assert base == f"ml-cluster|training/gpt-pretrain|hyperpod-{I1}|after-100"


def test_two_runs_of_the_same_job_are_two_incidents() -> None:
    # The same cluster, job, node and trusted step; the agent names its alarms "<run id>-<step>-<detector>".
    run_1 = alarm("alarm_ring_audit", alarm_id="0123456789abcdef-150-ring_audit")
    run_1_again = alarm("alarm_ring_audit", alarm_id="0123456789abcdef-151-ring_audit", publisher_rank=5)
    run_2 = alarm("alarm_ring_audit", alarm_id="fedcba9876543210-150-ring_audit")
    assert run_1.trusted_through_step() == run_2.trusted_through_step()
    assert idempotency_key(run_1) == idempotency_key(run_1_again)
    assert idempotency_key(run_1) != idempotency_key(run_2)
    assert incident_id_for(idempotency_key(run_1)) != incident_id_for(idempotency_key(run_2))


def test_incident_ids_are_valid_and_stable() -> None:
    key = idempotency_key(alarm("alarm_unlocalized"))
    assert "unlocalised" in key
    assert incident_id_for(key) == incident_id_for(key)
    assert incident_id_for(key).startswith("sdc-")
    assert len(incident_id_for(key)) == 24


# -- blast radius -----------------------------------------------------------------


def test_nodes_held_by_open_incidents_count_and_ended_ones_do_not() -> None:
    held = [
        incident("alarm_ring_audit", IncidentState.CORDONED, [(I1, "")]),
        incident("alarm_nonfinite_grad", IncidentState.CLOSED, [(I2, "")]),
        incident("alarm_two_nodes", IncidentState.CONTAINED, [(I3, "")]),
    ]
    assert quarantined_nodes(held, exclude="none") == {f"hyperpod-{I1}", f"hyperpod-{I3}"}


def test_a_new_incident_within_the_limit_is_allowed() -> None:
    mine = incident("alarm_two_nodes", IncidentState.RESOLVED, [(I2, "")])
    others = [incident("alarm_ring_audit", IncidentState.AWAITING_APPROVAL, [(I1, "")])]
    verdict = check_blast_radius(mine, others, max_quarantined_nodes=2, max_replacements_per_day=4, now=NOW)
    assert verdict.allowed
    assert verdict.quarantined == 1


def test_a_second_incident_beyond_the_quarantine_limit_is_refused() -> None:
    mine = incident("alarm_two_nodes", IncidentState.RESOLVED, [(I2, "")])
    others = [incident("alarm_ring_audit", IncidentState.CORDONED, [(I1, "")])]
    verdict = check_blast_radius(mine, others, max_quarantined_nodes=1, max_replacements_per_day=4, now=NOW)
    assert not verdict.allowed
    assert "would hold 2 nodes" in verdict.reason
    assert "limit is 1" in verdict.reason


def test_the_same_node_again_is_not_counted_twice() -> None:
    mine = incident("alarm_two_nodes", IncidentState.RESOLVED, [(I1, "")])
    others = [incident("alarm_ring_audit", IncidentState.CORDONED, [(I1, "")])]
    assert check_blast_radius(mine, others, max_quarantined_nodes=1, max_replacements_per_day=4, now=NOW).allowed


def test_replacements_in_the_last_day_count_against_the_daily_limit() -> None:
    mine = incident("alarm_two_nodes", IncidentState.RESOLVED, [(I3, "")])
    recent = incident("alarm_ring_audit", IncidentState.CLOSED, [(I1, "")], entered={IncidentState.REPLACING: NOW - timedelta(hours=3)})
    old = incident("alarm_nonfinite_grad", IncidentState.CLOSED, [(I2, "")], entered={IncidentState.REPLACING: NOW - timedelta(hours=30)})
    refused = check_blast_radius(mine, [recent, old], max_quarantined_nodes=5, max_replacements_per_day=1, now=NOW)
    allowed = check_blast_radius(mine, [recent, old], max_quarantined_nodes=5, max_replacements_per_day=2, now=NOW)
    assert not refused.allowed
    assert "1 replacement(s) in the last 24 h" in refused.reason
    assert allowed.allowed
    assert allowed.replacements_last_day == 1


def test_a_zero_limit_refuses_everything() -> None:
    mine = incident("alarm_ring_audit", IncidentState.RESOLVED, [(I1, "")])
    assert not check_blast_radius(mine, [], max_quarantined_nodes=0, max_replacements_per_day=4, now=NOW).allowed


# -- evidence verdicts --------------------------------------------------------------


def series(name: str, maximum: float | None, gpu: str = "0") -> MetricSeries:
    return MetricSeries(name=name, dimensions={"InstanceId": I1, "GpuDevice": gpu}, maximum=maximum, points=5)


DCGM = ["DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"]


def test_healthy_metrics_give_no_hardware_signal() -> None:
    verdict, reasons = verdict_for([series("node_gpu_temperature", 71), series("DCGM_FI_DEV_XID_ERRORS", 0)], DCGM, [])
    assert verdict == NO_HARDWARE_SIGNAL
    assert reasons == ["no DCGM error counter, thermal excursion or earlier approved incident for this instance"]


def test_a_nonzero_dcgm_counter_corroborates() -> None:
    verdict, reasons = verdict_for([series("DCGM_FI_DEV_XID_ERRORS", 79, gpu="3")], DCGM, [])
    assert verdict == CORROBORATED
    assert reasons == ["DCGM_FI_DEV_XID_ERRORS reached 79 on 3"]


def test_a_thermal_excursion_or_an_earlier_incident_corroborates() -> None:
    hot, why = verdict_for([series("node_gpu_temperature", 93)], DCGM, [])
    assert hot == CORROBORATED
    assert "93 C" in why[0]
    again, why = verdict_for([], DCGM, ["sdc-0001", "sdc-0001"])
    assert again == CORROBORATED
    assert why == ["suspect in 1 earlier incident(s) a reviewer approved: sdc-0001"]


def test_a_counter_not_configured_or_without_data_says_nothing() -> None:
    verdict, _ = verdict_for([series("DCGM_FI_DEV_POWER_VIOLATION", 12), series("DCGM_FI_DEV_XID_ERRORS", None)], DCGM, [])
    assert verdict == NO_HARDWARE_SIGNAL


def test_alarm_history_finds_other_incidents_of_the_instance() -> None:
    a = incident("alarm_ring_audit", IncidentState.CLOSED, [(I1, "")])
    b = incident("alarm_two_nodes", IncidentState.CORDONED, [(I1, ""), (I2, "")])
    assert prior_incidents_of(I1, [a, b], exclude=b.incident_id) == [a.incident_id]
    assert prior_incidents_of(I3, [a, b], exclude=b.incident_id) == []


def test_only_earlier_incidents_a_reviewer_approved_corroborate() -> None:
    approved = incident("alarm_ring_audit", IncidentState.CLOSED, [(I1, "")], entered={IncidentState.APPROVED: NOW})
    rejected = incident("alarm_two_nodes", IncidentState.FALSE_ALARM, [(I1, "")], entered={IncidentState.REJECTED: NOW})
    forged = incident("alarm_nonfinite_grad", IncidentState.NEEDS_ATTENTION, [(I1, "")])
    assert confirmed_incidents_of(I1, [approved, rejected, forged], exclude="") == [approved.incident_id]
    assert confirmed_incidents_of(I1, [rejected, forged], exclude="") == []


# -- replacement successors ----------------------------------------------------------


def test_the_successor_is_the_new_node_of_the_same_group_launched_after_the_request() -> None:
    from sdcguard.contract import Replacement

    requested = NOW
    inc = incident("alarm_ring_audit", IncidentState.REPLACING, [(I1, "")], entered={IncidentState.REPLACING: requested})
    inc = inc.model_copy(update={"replacements": [Replacement(old_instance_id=I1)], "suspects": [inc.suspects[0].model_copy(update={"instance_group": "workers"})]})
    new = "i-0fffffffffffffff1"
    nodes = {
        I2: ClusterNode(I2, "workers", "Running", launch_time=(NOW - timedelta(days=1)).timestamp()),
        "i-0eeeeeeeeeeeeeee1": ClusterNode("i-0eeeeeeeeeeeeeee1", "controllers", "Running", launch_time=(NOW + timedelta(seconds=9)).timestamp()),
        new: ClusterNode(new, "workers", "Pending", launch_time=(NOW + timedelta(seconds=10)).timestamp()),
    }
    found = find_successors(inc, nodes)
    assert found[I1] is not None
    assert found[I1].instance_id == new  # type: ignore[union-attr]
    assert find_successors(inc, {I2: nodes[I2]}) == {I1: None}


def test_a_node_listed_when_the_replacement_was_asked_for_is_never_its_successor() -> None:
    # A node of the group launched a moment before the request (inside the clock slack) by something else: the
    # replacement recorded it as already there, so only the node launched for it is taken.
    from sdcguard.contract import Replacement

    inc = incident("alarm_ring_audit", IncidentState.REPLACING, [(I1, "")], entered={IncidentState.REPLACING: NOW})
    around = "i-0ddddddddddddddd1"
    replacement = Replacement(old_instance_id=I1, present_before=[I1, around])
    inc = inc.model_copy(update={"replacements": [replacement],
                                 "suspects": [inc.suspects[0].model_copy(update={"instance_group": "workers"})]})
    new = "i-0fffffffffffffff1"
    nodes = {
        around: ClusterNode(around, "workers", "Running", launch_time=(NOW - timedelta(seconds=2)).timestamp()),
        new: ClusterNode(new, "workers", "Pending", launch_time=(NOW + timedelta(seconds=60)).timestamp()),
    }
    assert find_successors(inc, {around: nodes[around]}) == {I1: None}
    found = find_successors(inc, nodes)
    assert found[I1] is not None
    assert found[I1].instance_id == new  # type: ignore[union-attr]


# -- inputs and settings ---------------------------------------------------------------


def test_the_stored_event_parses_with_a_typed_detail() -> None:
    event = parse_input(AlarmEvent, load_event("alarm_ring_audit"))
    assert event.detail.suspects[0].node == f"hyperpod-{I1}"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda e: e.update(source="someone.else"), "source"),
        (lambda e: e["detail"].pop("job"), "detail.job"),
        (lambda e: e["detail"].update(step=-1), "detail.step"),
        (lambda e: e["detail"].update(schema_version="2"), "detail.schema_version"),
    ],
)
def test_a_malformed_event_is_refused_naming_the_field(change: Any, field: str) -> None:
    event = load_event("alarm_ring_audit")
    change(event)
    with pytest.raises(MalformedEvent, match=field.replace(".", r"\.")):
        parse_input(AlarmEvent, event)


def test_task_inputs_refuse_unknown_fields_and_bad_instance_ids() -> None:
    with pytest.raises(MalformedEvent, match="instance_id"):
        parse_input(InstanceRef, {"incident_id": "sdc-0123456789abcdef0123", "instance_id": "gpu-0"})
    with pytest.raises(MalformedEvent, match="force: Extra inputs"):
        parse_input(InstanceRef, {"incident_id": "sdc-0123456789abcdef0123", "instance_id": I1, "force": True})
    with pytest.raises(MalformedEvent, match="JSON object"):
        parse_input(InstanceRef, ["not", "an", "object"])


ENV = {
    "LEDGER_TABLE": "ledger",
    "IDEMPOTENCY_TABLE": "idem",
    "TOPIC_ARN": "arn:aws:sns:us-east-1:123456789012:sdcguard",
    "HYPERPOD_CLUSTER": "ml-cluster",
    "EKS_CLUSTER": "ml-eks",
    "CHECKPOINT_BUCKET": "ckpt-bucket",
}


def test_settings_read_the_environment() -> None:
    settings = Settings.from_env({**ENV, "MODE": "cordon_only", "DCGM_METRIC_NAMES": "A, B,,C", "APPROVAL_TIMEOUT_SECONDS": "600"})
    assert settings.mode == "cordon_only"
    assert settings.dcgm_metric_names == ("A", "B", "C")
    assert settings.timeouts()["approval_heartbeat_seconds"] == 600
    assert settings.timeouts()["approval_seconds"] == 660


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({k: v for k, v in ENV.items() if k != "TOPIC_ARN"}, "TOPIC_ARN"),
        ({**ENV, "MODE": "yolo"}, "MODE"),
        ({**ENV, "MAX_QUARANTINED_NODES": "-1"}, "MAX_QUARANTINED_NODES"),
        ({**ENV, "TOPIC_ARN": "not-an-arn"}, "TOPIC_ARN"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        Settings.from_env(env)


def test_the_pointer_is_only_rewritten_at_exactly_the_guarded_prefix() -> None:
    assert allowed_prefix("s3://ckpt-bucket/jobs/gpt-pretrain", bucket="ckpt-bucket", prefix="jobs/gpt-pretrain")
    assert allowed_prefix("s3://ckpt-bucket/jobs/gpt-pretrain/", bucket="ckpt-bucket", prefix="/jobs/gpt-pretrain/")
    assert allowed_prefix("s3://ckpt-bucket", bucket="ckpt-bucket", prefix="")
    # not a sub-prefix: another job's checkpoints under the guarded prefix, or the whole bucket
    assert not allowed_prefix("s3://ckpt-bucket/jobs/gpt-pretrain", bucket="ckpt-bucket", prefix="jobs")
    assert not allowed_prefix("s3://ckpt-bucket/jobs/gpt-pretrain", bucket="ckpt-bucket", prefix="")
    assert not allowed_prefix("s3://ckpt-bucket/jobs/gpt-pretrain/../other", bucket="ckpt-bucket", prefix="jobs/gpt-pretrain")
    assert not allowed_prefix("s3://ckpt-bucket/jobsX/a", bucket="ckpt-bucket", prefix="jobs")
    assert not allowed_prefix("s3://other/jobs/a", bucket="ckpt-bucket", prefix="jobs")
    assert not allowed_prefix("/local/dir", bucket="ckpt-bucket", prefix="")


# -- the EKS token ---------------------------------------------------------------------


def test_the_eks_token_is_a_presigned_get_caller_identity_signing_the_cluster() -> None:
    import base64
    from urllib.parse import parse_qs, urlparse

    import boto3

    from sdcguard.lambdas.eks_token import eks_token

    sts = boto3.client(
        "sts", region_name="us-east-1", aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret", endpoint_url="https://sts.us-east-1.amazonaws.com"
    )
    token = eks_token("ml-eks", sts)

    assert token.startswith("k8s-aws-v1.")
    assert "=" not in token
    body = token.removeprefix("k8s-aws-v1.")
    url = urlparse(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode())
    query = parse_qs(url.query)
    assert url.netloc == "sts.us-east-1.amazonaws.com"
    assert query["Action"] == ["GetCallerIdentity"]
    assert query["X-Amz-Expires"] == ["60"]
    assert "x-k8s-aws-id" in query["X-Amz-SignedHeaders"][0].split(";")
    # the hooks are gone: the client presigns plain URLs again
    plain = sts.generate_presigned_url("get_caller_identity", ExpiresIn=60)
    assert "x-k8s-aws-id" not in plain


# -- suspects verified against the cluster -----------------------------------------------------------


def suspect_of(name: str) -> Any:
    return alarm(name).suspects[0]


def test_the_cluster_agreeing_with_the_alarm_is_no_mismatch() -> None:
    s = suspect_of("alarm_ring_audit")
    seen = Observed(pod_exists=True, job_name="gpt-pretrain", node=s.node, node_exists=True, owner_uid="uid-1")
    assert mismatch(s, seen, namespace="training", job_name="gpt-pretrain") is None


def test_a_pod_no_pytorchjob_controls_is_a_mismatch() -> None:
    s = suspect_of("alarm_ring_audit")
    seen = Observed(pod_exists=True, job_name="gpt-pretrain", node=s.node, node_exists=True)
    assert "not controlled by a PyTorchJob" in str(mismatch(s, seen, namespace="training", job_name="gpt-pretrain"))


def test_a_pod_of_another_job_uid_or_made_after_the_alarm_is_another_run() -> None:
    a = alarm("alarm_ring_audit")
    s = a.suspects[0]
    raised = a.time if a.time.tzinfo else a.time.replace(tzinfo=UTC)
    base = Observed(pod_exists=True, job_name="gpt-pretrain", node=s.node, node_exists=True, owner_uid="uid-now",
                    created=raised - timedelta(hours=1))  # fmt: skip
    assert stale(s, base, alarm=a, uid="uid-now") is None
    assert "uid 'uid-now', not to the job's current uid 'uid-then'" in str(stale(s, base, alarm=a, uid="uid-then"))
    restarted = Observed(**{**base.__dict__, "created": raised + timedelta(minutes=5)})
    assert "after the alarm" in str(stale(s, restarted, alarm=a, uid="uid-now"))
    skewed = Observed(**{**base.__dict__, "created": raised + timedelta(seconds=30)})
    assert stale(s, skewed, alarm=a, uid="uid-now") is None  # clock skew, not a restart


def test_an_alarm_older_than_the_setting_is_stale() -> None:
    a = alarm("alarm_ring_audit")
    raised = a.time if a.time.tzinfo else a.time.replace(tzinfo=UTC)
    check_fresh(a, max_age_seconds=3600, now=raised + timedelta(minutes=59))
    with pytest.raises(StaleAlarm, match="MAX_ALARM_AGE_SECONDS=3600"):
        check_fresh(a, max_age_seconds=3600, now=raised + timedelta(minutes=61))


@pytest.mark.parametrize(
    ("seen", "named"),
    [
        (Observed(pod_exists=False), "does not exist in namespace training"),
        (Observed(pod_exists=True, job_name="other-job", node=f"hyperpod-{I1}", node_exists=True), "not a pod of PyTorchJob training/gpt-pretrain"),
        (Observed(pod_exists=True, job_name=None, node=f"hyperpod-{I1}", node_exists=True), "no job-name label"),
        (Observed(pod_exists=True, job_name="gpt-pretrain", node=f"hyperpod-{I2}", node_exists=True), f"runs on node 'hyperpod-{I2}'"),
        (Observed(pod_exists=True, job_name="gpt-pretrain", node=f"hyperpod-{I1}", node_exists=False), "does not exist"),
    ],
)
def test_a_suspect_the_cluster_contradicts_is_a_mismatch_named_in_the_reason(seen: Observed, named: str) -> None:
    reason = mismatch(suspect_of("alarm_ring_audit"), seen, namespace="training", job_name="gpt-pretrain")
    assert reason is not None
    assert named in reason
    assert reason.startswith("rank 3: pod gpt-pretrain-worker-1")


def test_a_host_name_from_the_alarm_never_resolves_a_node() -> None:
    # The alarm names an unknown node and, as its host, the DNS name of another node of the cluster.
    nodes = cluster(I1, I2)
    forged = alarm(
        "alarm_renamed_node",
        suspects=[{**load_event("alarm_renamed_node")["detail"]["suspects"][0], "node": "ip-10-9-9-9.ec2.internal", "host": nodes[I2].private_dns}],
    )
    with pytest.raises(SuspectUnresolvable, match="ip-10-9-9-9"):
        resolve_suspects(forged, nodes)


def test_a_renamed_node_resolves_through_its_own_addresses() -> None:
    nodes = {I1: ClusterNode(I1, "workers", "Running", private_dns="ip-10-1-35-77.ec2.internal")}
    a = alarm("alarm_renamed_node")  # node ip-10-1-35-103.ec2.internal
    resolved = resolve_suspects(a, nodes, node_addresses={a.suspects[0].node: ("10.1.35.77", "ip-10-1-35-77.ec2.internal")})
    assert [s.instance_id for s in resolved] == [I1]


def test_without_a_job_namespace_no_alarm_is_in_scope() -> None:
    a = alarm("alarm_ring_audit")
    with pytest.raises(NotInCluster, match="guards no namespace"):
        check_scope(a, Settings.from_env(ENV))
    with pytest.raises(NotInCluster, match="namespace training; this pipeline guards other"):
        check_scope(a, Settings.from_env({**ENV, "JOB_NAMESPACE": "other", "JOB_NAME": "gpt-pretrain"}))
    check_scope(a, Settings.from_env({**ENV, "JOB_NAMESPACE": "training", "JOB_NAME": "gpt-pretrain"}))


def test_without_a_job_name_no_alarm_is_in_scope_and_another_job_is_not_the_guarded_one() -> None:
    a = alarm("alarm_ring_audit")  # job training/gpt-pretrain
    with pytest.raises(NotInCluster, match=r"guards no job \(JobName / JOB_NAME is empty\)"):
        check_scope(a, Settings.from_env({**ENV, "JOB_NAMESPACE": "training"}))
    other_job = Settings.from_env({**ENV, "JOB_NAMESPACE": "training", "JOB_NAME": "gpt-finetune"})
    check_scope(a, other_job)  # recorded: the question is resolve's
    with pytest.raises(NotInCluster, match=r"PyTorchJob training/'gpt-pretrain'; this pipeline guards training/'gpt-finetune'"):
        check_job(a, other_job)
    check_job(a, Settings.from_env({**ENV, "JOB_NAMESPACE": "training", "JOB_NAME": "gpt-pretrain"}))


# -- what counts toward the blast radius ------------------------------------------------------------------


def test_a_failed_incident_that_was_admitted_counts_until_its_node_is_released() -> None:
    failed = incident("alarm_ring_audit", IncidentState.FAILED, [(I1, "")], entered={IncidentState.GUARDED: NOW, IncidentState.CORDONED: NOW})
    early = incident("alarm_two_nodes", IncidentState.FAILED, [(I2, "")], entered={IncidentState.RESOLVED: NOW})
    assert quarantined_nodes([failed, early], exclude="") == {f"hyperpod-{I1}"}
    assert counts_until(failed) == FOREVER
    assert counts_until(early) is None
    # seen released on the cluster: it stops counting, and says so in the ledger item
    assert quarantined_nodes([failed], exclude="", released={f"hyperpod-{I1}"}) == set()
    released = failed.model_copy(update={"nodes_released_at": NOW})
    assert quarantined_nodes([released], exclude="") == set()
    assert counts_until(released) is None


def test_replacements_count_for_a_day_and_closed_incidents_leave_the_index() -> None:
    replaced = incident("alarm_ring_audit", IncidentState.CLOSED, [(I1, "")], entered={IncidentState.REPLACING: NOW})
    assert counts_until(replaced) == (NOW + timedelta(hours=24)).timestamp()
    assert counts_until(incident("alarm_ring_audit", IncidentState.FALSE_ALARM, [(I1, "")])) is None
    assert counts_until(incident("alarm_ring_audit", IncidentState.RECORDED, [(I1, "")])) == FOREVER
    item = Ledger._item(replaced, 1)
    assert (item["open_cluster"]["S"], float(item["open_until"]["N"])) == ("ml-cluster", counts_until(replaced))
    assert "open_cluster" not in Ledger._item(incident("alarm_ring_audit", IncidentState.FALSE_ALARM, [(I1, "")]), 1)


# -- the reviewers' notification ---------------------------------------------------------------------------


def test_untrusted_strings_cannot_forge_lines_in_the_notification() -> None:
    forged_line = f"Suspect: rank 7 pod x node hyperpod-{I2} instance {I2}"
    a = alarm("alarm_ring_audit", message=f"all fine\n{forged_line}\n  sdcguard approve sdc-evil --reason now")
    inc = incident("alarm_ring_audit", IncidentState.EVIDENCE_COLLECTED, [(I1, "")]).model_copy(update={"alarm": a})
    text = approval_message(inc)
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("Suspect:")] == [f'Suspect: rank 0 pod "p0" node "hyperpod-{I1}" instance {I1}']
    assert not any("sdc-evil" in line and line.lstrip().startswith("sdcguard approve") for line in lines)
    assert f'Agent says: "all fine\\n{forged_line}\\n  sdcguard approve sdc-evil --reason now"' in lines


def test_the_notification_says_whether_the_fault_persisted() -> None:
    inc = incident("alarm_ring_audit", IncidentState.EVIDENCE_COLLECTED, [(I1, "")])
    persistent = inc.model_copy(update={"alarm": alarm("alarm_ring_audit", fault_persistence="persistent")})
    assert "Fault persistence: persistent: the suspect replayed its computation and got it wrong again" in describe(persistent)
    assert "Fault persistence: unknown" in describe(inc)


# -- the job's holders ---------------------------------------------------------------------------------------


def test_the_incidents_holding_a_job_are_read_from_its_annotation() -> None:
    assert holders({"metadata": {"annotations": {"sdcguard.io/suspended-by": "sdc-a, sdc-b,"}}}) == ["sdc-a", "sdc-b"]
    assert holders({"metadata": {}}) == []


# -- throttling that outlasted the clients' retries --------------------------------------------------------------


def test_throttling_after_the_clients_retries_is_raised_by_name() -> None:
    from botocore.exceptions import ClientError

    from sdcguard.lambdas.clients import CONFIG, named_throttling
    from sdcguard.lambdas.errors import Throttled

    def failing(code: str) -> Any:
        @named_throttling
        def handler() -> None:
            raise ClientError({"Error": {"Code": code, "Message": "slow down"}}, "ListClusterNodes")

        return handler

    with pytest.raises(Throttled, match="ListClusterNodes: ThrottlingException: slow down"):
        failing("ThrottlingException")()
    with pytest.raises(Throttled):
        failing("TooManyRequestsException")()
    with pytest.raises(ClientError, match="AccessDenied"):  # not throttling: the user must see it as it is
        failing("AccessDeniedException")()
    # Once a client is built from it, botocore rewrites max_attempts as total_max_attempts (one more).
    retries = dict(CONFIG.retries)  # type: ignore[attr-defined]  # botocore-stubs give Config's options as arguments only
    assert retries.pop("mode") == "standard"
    assert retries in ({"max_attempts": 5}, {"total_max_attempts": 6})


def test_a_stopped_incident_holds_until_its_rejected_replacement_node_is_released_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sdcguard.contract import NodeCheck
    from sdcguard.contract.incident import REPLACEMENT_REJECTED, Replacement
    from sdcguard.lambdas import guard

    stopped = incident("alarm_ring_audit", IncidentState.NEEDS_ATTENTION, [(I1, "")],
                       entered={IncidentState.GUARDED: NOW, IncidentState.CORDONED: NOW})
    stopped = stopped.model_copy(update={
        "replacements": [Replacement(old_instance_id=I1, new_instance_id=I2, status=REPLACEMENT_REJECTED)],
        "node_checks": [NodeCheck(purpose="qualify", node=f"hyperpod-{I2}", instance_id=I2, repeats=2, state="failed")],
    })
    updated: list[str] = []

    class Ledger:  # what _count_releases uses of the ledger
        @staticmethod
        def update(incident_id: str, change: Any) -> Incident:
            updated.append(incident_id)
            result: Incident = change(stopped)
            return result

    asked: list[set[str]] = []

    def seen_released(released: set[str]) -> Any:
        def released_nodes(_api: Any, nodes: Any) -> set[str]:
            asked.append(set(nodes))
            return released
        return released_nodes

    # The suspect's node is uncordoned, the rejected replacement is not: the incident still holds.
    monkeypatch.setattr(guard, "released_nodes", seen_released({f"hyperpod-{I1}"}))
    [still] = guard._count_releases(Ledger(), [stopped], lambda: None, exclude="")  # type: ignore[arg-type]
    assert asked == [{f"hyperpod-{I1}", f"hyperpod-{I2}"}]
    assert still.nodes_released_at is None
    assert updated == []
    monkeypatch.setattr(guard, "released_nodes", seen_released({f"hyperpod-{I1}", f"hyperpod-{I2}"}))
    [freed] = guard._count_releases(Ledger(), [stopped], lambda: None, exclude="")  # type: ignore[arg-type]
    assert freed.nodes_released_at is not None
    assert updated == [stopped.incident_id]
