"""The agent/pipeline contract: sample events round-trip, malformed ones are refused by field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from sdcguard.contract import (
    Alarm,
    CheckpointManifest,
    Decision,
    IllegalTransition,
    Incident,
    IncidentState,
    ObjectDigest,
    PointerEntry,
    ProductCheckEvidence,
    ResumePointer,
    checkpoint_dir,
    step_of_dir,
)
from sdcguard.contract import schema as contract_schema
from tests.events import event_names, load_event


def _detail(name: str = "alarm_ring_audit") -> dict[str, Any]:
    return copy.deepcopy(load_event(name)["detail"])


def _error_locations(exc: ValidationError) -> list[str]:
    return [".".join(str(p) for p in err["loc"]) for err in exc.errors()]


@pytest.mark.parametrize("name", event_names())
def test_every_sample_event_round_trips(name: str) -> None:
    event = load_event(name)
    assert event["source"] == "sdcguard.agent"
    assert event["detail-type"] == "SDC Alarm"

    alarm = Alarm.model_validate(event["detail"])
    again = Alarm.model_validate_json(alarm.model_dump_json())

    assert again == alarm
    assert again.model_dump(mode="json") == alarm.model_dump(mode="json")


def _without(data: dict[str, Any], key: str) -> dict[str, Any]:
    del data[key]
    return data


def _with(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node: Any = data
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return data


MALFORMED = {
    "unknown schema version": (lambda d: _with(d, "schema_version", "2"), "schema_version"),
    "missing job": (lambda d: _without(d, "job"), "job"),
    "missing step": (lambda d: _without(d, "step"), "step"),
    "step of the wrong type": (lambda d: _with(d, "step", "two hundred"), "step"),
    "negative step": (lambda d: _with(d, "step", -1), "step"),
    "negative rank": (lambda d: _with(d, "suspects.0.global_rank", -3), "suspects.0.global_rank"),
    "suspect outside the world": (lambda d: _with(d, "suspects.0.global_rank", 6), "suspects.0.global_rank"),
    "local rank beyond the node": (lambda d: _with(d, "suspects.0.local_rank", 2), "suspects.0.local_rank"),
    "over-long pod name": (lambda d: _with(d, "suspects.0.pod", "p" * 254), "suspects.0.pod"),
    "over-long message": (lambda d: _with(d, "message", "m" * 5000), "message"),
    "over-long namespace": (lambda d: _with(d, "job.namespace", "n" * 64), "job.namespace"),
    "unknown detector": (lambda d: _with(d, "detector", "vibes"), "detector"),
    "unknown field": (lambda d: _with(d, "colour", "red"), "colour"),
    "evidence of another detector": (lambda d: _with(d, "detector", "weight_fingerprint"), "evidence.kind"),
    "localised without suspects": (lambda d: _with(d, "suspects", []), "suspects"),
    "empty ring evidence": (lambda d: _with(d, "evidence.pairs", []), "evidence.ring_audit.pairs"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_alarms_are_refused_naming_the_field(case: str) -> None:
    mutate, field = MALFORMED[case]
    with pytest.raises(ValidationError) as info:
        Alarm.model_validate(mutate(_detail()))
    text = str(info.value)
    assert field in _error_locations(info.value) or field in text, text


def test_trusted_step_takes_the_earlier_of_the_sampled_detectors() -> None:
    ring = Alarm.model_validate(_detail("alarm_ring_audit"))
    weights = Alarm.model_validate(_detail("alarm_weight_fingerprint"))
    nonfinite = Alarm.model_validate(_detail("alarm_nonfinite_grad"))

    assert ring.trusted_through_step() == 100  # last clean audit, before last clean weights (190)
    assert weights.trusted_through_step() == 100  # ring audit at 100 is earlier than weights at 120
    assert nonfinite.trusted_through_step() == 50


def test_trusted_step_without_any_clean_check_is_minus_one() -> None:
    data = _with(_detail(), "last_clean", {"ring_audit": None, "weight_fingerprint": None})
    assert Alarm.model_validate(data).trusted_through_step() == -1


def test_json_schemas_are_in_sync_with_the_models() -> None:
    assert contract_schema.stale() == [], "run: python -m sdcguard.contract.schema"


def test_checkpoint_dirs_encode_the_step() -> None:
    assert checkpoint_dir(1200) == "checkpoints/step-000001200"
    assert step_of_dir("checkpoints/step-000001200/") == 1200
    assert step_of_dir("checkpoints/latest") is None
    with pytest.raises(ValueError, match="step"):
        checkpoint_dir(-1)


def _manifest(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "step": 100,
        "world_size": 6,
        "fingerprint": "0123456789abcdef" * 3,
        "objects": [{"name": "model.pt", "sha256": "a" * 64, "size": 10}],
    }
    data.update(overrides)
    return data


def test_manifest_refuses_path_like_and_duplicate_object_names() -> None:
    CheckpointManifest.model_validate(_manifest())
    for bad in ("../model.pt", "a/b.pt", "MANIFEST.json", ""):
        with pytest.raises(ValidationError, match=r"objects\.0\.name"):
            CheckpointManifest.model_validate(_manifest(objects=[{"name": bad, "sha256": "a" * 64, "size": 1}]))
    twice = [ObjectDigest(name="x.pt", sha256="b" * 64, size=1).model_dump()] * 2
    with pytest.raises(ValidationError, match="unique"):
        CheckpointManifest.model_validate(_manifest(objects=twice))


def test_manifest_refuses_a_malformed_fingerprint() -> None:
    with pytest.raises(ValidationError, match="fingerprint"):
        CheckpointManifest.model_validate(_manifest(fingerprint="not-hex"))


def test_pointer_keeps_its_history_newest_first() -> None:
    first = ResumePointer(checkpoint=checkpoint_dir(100), step=100, reason="save", written_by="rank-0")
    second = first.moved_to(200, reason="save", written_by="rank-0")
    third = second.moved_to(100, reason="rollback", written_by="sdcguard", incident_id="inc-1234567")

    assert third.step == 100
    assert third.incident_id == "inc-1234567"
    assert [h.step for h in third.history] == [200, 100]
    assert ResumePointer.model_validate_json(third.model_dump_json()) == third


def test_pointer_entry_must_name_the_step_it_holds() -> None:
    with pytest.raises(ValidationError, match="does not hold step"):
        PointerEntry(checkpoint=checkpoint_dir(100), step=200, reason="x", written_by="me")


def _incident() -> Incident:
    return Incident(
        incident_id="inc-00000001",
        idempotency_key="ml-cluster/gpt-pretrain/i-0123456789abcdef0/100",
        alarm=Alarm.model_validate(_detail()),
    )


def test_incident_moves_along_the_lifecycle_and_records_each_transition() -> None:
    incident = _incident()
    for state in (IncidentState.RESOLVED, IncidentState.GUARDED, IncidentState.SUSPENDED):
        incident = incident.advance(state, actor="test")

    assert incident.state == IncidentState.SUSPENDED
    assert [t.state for t in incident.transitions] == ["RESOLVED", "GUARDED", "SUSPENDED"]
    assert incident.entered(IncidentState.GUARDED) is not None


def test_incident_refuses_to_skip_approval() -> None:
    incident = _incident().advance(IncidentState.RESOLVED, actor="test")
    with pytest.raises(IllegalTransition, match="RESOLVED -> REPLACING"):
        incident.advance(IncidentState.REPLACING, actor="test")


def test_repeating_a_transition_records_nothing_new() -> None:
    incident = _incident().advance(IncidentState.RESOLVED, actor="test")
    assert incident.advance(IncidentState.RESOLVED, actor="retry") is incident


def test_terminal_states_are_final() -> None:
    incident = _incident().advance(IncidentState.FAILED, actor="test", note="boom")
    assert incident.state.terminal
    with pytest.raises(IllegalTransition):
        incident.advance(IncidentState.RESOLVED, actor="test")


def test_decision_needs_a_reviewer_and_a_reason() -> None:
    with pytest.raises(ValidationError, match="reviewer"):
        Decision(decision="approve", reviewer="", reason="ok")
    with pytest.raises(ValidationError, match="decision"):
        Decision.model_validate({"decision": "maybe", "reviewer": "alice", "reason": "ok"})


def test_the_product_check_and_the_magnitude_trigger_name_themselves_and_older_alarms_still_validate() -> None:
    # An older agent's trigger-asked alarm (detector ring_audit, trigger "magnitude") still validates.
    older = _with(_detail(), "evidence.trigger", "magnitude")
    assert Alarm.model_validate(older).detector.value == "ring_audit"
    # Today's: the magnitude trigger's own detector with the ring pairs' evidence, and the product check's.
    trigger = _with(_with(_detail(), "detector", "magnitude_trigger"), "evidence.kind", "magnitude_trigger")
    assert Alarm.model_validate(_with(trigger, "evidence.trigger", "magnitude")).evidence.kind == "magnitude_trigger"
    product = _with(_with(_detail(), "detector", "product_check"), "evidence",
                    {"kind": "product_check", "sites": [{"rank": 3, "site": "blocks.0.fc forward"}]})
    alarm = Alarm.model_validate(product)
    assert isinstance(alarm.evidence, ProductCheckEvidence)
    assert alarm.evidence.sites[0].site == "blocks.0.fc forward"
    # A per-step check: its own step, bounded by the sampled checks that ran, as for the non-finite check.
    assert alarm.trusted_through_step() == min(alarm.step, 100)
    # The evidence must still match the detector.
    with pytest.raises(ValidationError) as exc:
        Alarm.model_validate(_with(_detail(), "detector", "product_check"))
    assert "evidence.kind" in _error_locations(exc.value)
    with pytest.raises(ValidationError):
        Alarm.model_validate(_with(product, "evidence.sites", []))
