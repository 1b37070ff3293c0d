"""What a drill learned, as a typed summary: the report's ``summary.json`` and ``sdcguard drill --json``.

A field is in the JSON once a stage has set it (``as_json`` dumps the set
fields only), so a drill that failed at detection says nothing about a
replacement it never reached, rather than ``null``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(validate_assignment=True, extra="forbid")


class Published(_Model):
    """What became of the alarm on the rank that published it (the agent's ``PublishOutcome``)."""

    model_config = ConfigDict(extra="allow")  # the rank's record as it is, should it say more

    delivered: bool = False
    event_id: str | None = None
    attempts: int = 0
    spooled: list[str] = []
    error: str | None = None


class ReplacementRow(_Model):
    """One node replacement the incident recorded."""

    old: str
    new: str | None
    status: str


class NodeCheckRow(_Model):
    """One replay of the suspect's capsule on a node, as the ledger recorded it (``sdcguard.contract.NodeCheck``)."""

    purpose: Literal["reproduce", "qualify"]
    node: str
    instance_id: str | None = None
    state: str
    """passed, failed, skipped, inconclusive (or running, when the drill stopped first)."""
    repeats: int = 0
    matched: int = 0
    reproduced: int = 0
    summary: str = ""
    """The pipeline's line for the reviewer: ``reproduced 5/5: persistent``, ``qualified 5/5 on <node>``."""
    seconds_after_alarm: float | None = None
    """When the check finished."""


class CallChaos(_Model):
    """Chaos on one kind of call (``"kubernetes PATCH nodes"``, ``"hyperpod ListClusterNodes"``)."""

    injected: dict[str, int]
    """Faults injected, by status (429, 500, 503)."""
    retried: int
    """Of those, faults a later attempt of the same call followed (the retry that absorbed it)."""


class ChaosSummary(_Model):
    """What the chaos knobs did during the drill, and what absorbed it."""

    rate: float
    """The fraction of Kubernetes API and SageMaker HyperPod calls failed transiently."""
    seed: int
    faults_injected: int
    retries_absorbed: int
    """Faults followed by a successful-looking retry of the same call (counted on the stand-in's side)."""
    not_retried: int
    """Faults no later attempt of the same call followed: something tolerated the failure without a retry."""
    by_call: dict[str, CallChaos]
    state_retries: dict[str, int]
    """Lambda invocations the incident machine retried, by state (from the execution history)."""
    state_errors: dict[str, int]
    """The errors those retries absorbed, as ``"State: Error"`` (from the execution history)."""
    incidents_opened: int
    """Incidents the ledger opened for the job during the drill: one, however often a call was retried."""


class DrillSummary(_Model):
    """The drill's summary; each stage fills in what it learned."""

    fault: str | None = None
    sharding: str | None = None
    """ddp or hsdp: how the drill's job held its weights."""
    fault_rank: int | None = None
    fault_step: int | None = None
    steps: int | None = None
    expected_detector: str | None = None
    decision: str | None = None
    hyperpod_cluster: str | None = None
    stack: str | None = None
    report_dir: str | None = None
    drill_seconds: dict[str, float] = Field(default_factory=dict)
    """Seconds each phase of the drill took (training runs, pipeline, report; the command adds set-up)."""

    old_instances: list[str] | None = None
    fault_instance: str | None = None
    clean_fingerprint: str | None = None

    detector: str | None = None
    alarm_step: int | None = None
    alarm_id: str | None = None
    suspect_ranks: list[int] | None = None
    suspect_nodes: list[str] | None = None
    suspect_instances: list[str] | None = None
    trusted_through_step: int | None = None
    published: Published | None = None
    faulty_exit_codes: list[int] | None = None
    localized_correctly: bool | None = None

    incident_id: str | None = None
    incident_state: str | None = None
    pointer_before: str | None = None
    pointer_after: str | None = None
    phase_seconds: dict[str, float | None] | None = None
    """Seconds from the alarm to each later phase (see ``report.PHASES``)."""
    new_instances: list[str] | None = None
    replacements: list[ReplacementRow] | None = None
    node_checks: list[NodeCheckRow] | None = None
    """Every replay of the capsule on a node the incident recorded, in the order they were started."""
    suspect_reproduced: str | None = None
    """``"k/n"``: the repetitions of the suspect's step on its cordoned node that did not give the healthy bits;
    null when the reproduction did not run or gave no answer (``suspect_reproduction`` says why)."""
    suspect_reproduction: str | None = None
    """The reproduction's line as the reviewer saw it (``reproduced 5/5: persistent``, ``not run: ...``)."""
    replacement_qualified: bool | list[bool | None] | None = None
    """Whether the new node matched the capsule N/N (one per new node, in order, when several were checked);
    null when none was qualified (``replacement_qualification`` says why)."""
    replacement_qualification: str | None = None
    """The qualifications' lines, or why there was none."""
    replacement_faulty: bool | None = None
    """``--replacement-faulty``: the stand-in's replacements of the faulty node carried its fault."""
    resumed_onto_unqualified: bool | None = None
    """Whether the job was resumed onto a new node that did not pass its qualification (the drill fails if so)."""
    replacement_outcome: str | None = None
    """What kept the job off an unqualified node: a further replacement that qualified, or NEEDS_ATTENTION."""
    chaos: ChaosSummary | None = None

    resumed_from_step: int | None = None
    recovered_fingerprint: str | None = None
    recovered_bit_exact: bool | None = None
    recovery_claim: str | None = None

    verdict: Literal["PASSED", "FAILED"] | None = None
    failed_step: str | None = None
    failure: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The fields stages have set, as JSON-ready values."""
        return self.model_dump(mode="json", exclude_unset=True)
