"""What each handler returns: one model per handler, dumped to JSON for the state machine.

The ASL's ``ResultSelector``\\ s read these fields by name, so a field renamed
here is a field renamed there.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Output(BaseModel):
    """Base of the handlers' results."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(Output):
    """The bounds the state machine reads from its data (see ``Settings.timeouts``)."""

    approval_heartbeat_seconds: int
    approval_seconds: int
    replacement_poll_seconds: int
    replacement_max_polls: int
    node_check_poll_seconds: int
    node_check_max_polls: int


class Recorded(Output):
    """record: the incident opened (or counted into)."""

    incident_id: str
    duplicate: bool
    mode: str
    timeouts: Timeouts
    topic_arn: str
    """The reviewers' topic: the state machine publishes to it itself if an ending handler fails."""


class Resolved(Output):
    """resolve: the suspect instances, each confirmed by the cluster."""

    incident_id: str
    instance_ids: list[str]


class Guarded(Output):
    """guard: whether the incident goes ahead."""

    incident_id: str
    action: Literal["proceed", "dry_run"]
    mode: str


class JobChanged(Output):
    """suspend_job, resume_job: what happened to the PyTorchJob."""

    incident_id: str
    job: str
    changed: bool
    held_by: list[str] = []
    """The incidents holding the job suspended afterwards."""


class Cordoned(Output):
    """cordon: one node."""

    incident_id: str
    instance_id: str
    node: str
    changed: bool


class Evidence(Output):
    """evidence: the summary the reviewers see."""

    model_config = ConfigDict(extra="allow", frozen=True)

    incident_id: str
    verdict: str
    note: str = ""
    instances: list[dict[str, Any]] = []


class Ended(Output):
    """request_approval, release, needs_attention, fail, decide's incident: where the incident stands."""

    incident_id: str | None
    state: str


class Closed(Output):
    """close: the final state and the timings."""

    incident_id: str
    state: str
    timings: dict[str, float]


class ReplacementRequested(Output):
    """replace: one instance's replacement."""

    incident_id: str
    instance_id: str
    status: str


class ReplacementPoll(Output):
    """replacement_status: one turn of the wait loop."""

    incident_id: str
    attempt: int
    done: bool
    failed: bool
    exhausted: bool
    pending: list[str]


class PointerRewritten(Output):
    """rewrite_pointer: the pointer before and after."""

    incident_id: str
    checkpoint_before: str | None
    checkpoint_after: str | None
    resumed_from_step: int | None


class Decided(Output):
    """decide: the decision delivered and recorded."""

    incident_id: str
    state: str
    decision: str
    reviewer: str
    execution_arn: str | None = None


class NodeChecksStarted(Output):
    """start_node_check: the replay Jobs created, and the nodes skipped (no capsule, Job refused)."""

    incident_id: str
    purpose: Literal["reproduce", "qualify"]
    started: int
    skipped: int
    attempt: int = 0
    """The wait loop's counter, starting at 0 (node_check_status counts each poll)."""


class NodeCheckPoll(Output):
    """node_check_status: one turn of the node check wait loop."""

    incident_id: str
    purpose: Literal["reproduce", "qualify"]
    attempt: int
    done: bool
    exhausted: bool
    summary: str
    """``reproduced 5/5: persistent`` / ``reproduced 0/5`` / ``not run: ...`` / ``inconclusive: ...``;
    ``qualified 5/5 on <node>`` per new node, joined."""
    qualified: bool | None
    """qualify: True every new node matched N/N; False one failed or gave no answer (it must not be
    resumed onto); None none was checked (no capsule). Always None for reproduce."""
    failed_instance_ids: list[str]


class ReplacementRejected(Output):
    """reject_replacement: the new nodes that failed qualification (cordoned) and whether to replace them."""

    incident_id: str
    replace_again: bool
    instance_ids: list[str]
    reason: str
