"""The incident record of the ledger: one per fault, with its states and transitions.

The state machine's handlers move an incident forward with :meth:`Incident.advance`,
which refuses a transition the lifecycle does not allow, so the ledger can never
claim that a node was replaced before anyone approved it.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from pydantic import Field

from sdcguard.contract.alarm import Alarm, Name, Rank, Step, Strict, Text

INCIDENT_SCHEMA_VERSION: Final = "1"
InstanceId = Annotated[str, Field(pattern=r"^i-[0-9a-f]{8,17}$")]


class IllegalTransition(ValueError):
    """The lifecycle does not allow this state change."""


class IncidentState(enum.StrEnum):
    """Where an incident stands. Terminal states end the incident."""

    RECORDED = "RECORDED"
    RESOLVED = "RESOLVED"
    GUARDED = "GUARDED"
    SUSPENDED = "SUSPENDED"
    CORDONED = "CORDONED"
    EVIDENCE_COLLECTED = "EVIDENCE_COLLECTED"
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    REPLACING = "REPLACING"
    REPLACED = "REPLACED"
    POINTER_REWRITTEN = "POINTER_REWRITTEN"
    RESUMED = "RESUMED"
    # Terminal states.
    CLOSED = "CLOSED"
    """Replaced, rolled back to a clean checkpoint, and resumed."""
    FALSE_ALARM = "FALSE_ALARM"
    """A reviewer rejected: node uncordoned, pointer left, job resumed."""
    CONTAINED = "CONTAINED"
    """Cordon-only mode: the node stays cordoned and the job suspended for a human."""
    DRY_RUN = "DRY_RUN"
    """Dry-run mode: everything was decided and recorded, nothing was touched."""
    NEEDS_ATTENTION = "NEEDS_ATTENTION"
    """A safe stop (approval timed out, limits reached): node cordoned, job suspended."""
    FAILED = "FAILED"
    """A step failed; the record says where and why."""
    ABORTED = "ABORTED"
    """An operator aborted it (``sdcguard incidents abort``): its execution stopped, what it had cordoned
    uncordoned, its hold on the job released."""
    RELEASED = "RELEASED"
    """After a stop that left nodes held (NEEDS_ATTENTION, CONTAINED, FAILED), an operator released them
    (``sdcguard incidents release``): uncordoned, the job's hold freed."""

    @property
    def terminal(self) -> bool:
        """Whether no further transition is allowed."""
        return self in _TERMINAL


_TERMINAL = frozenset(
    {
        IncidentState.CLOSED,
        IncidentState.FALSE_ALARM,
        IncidentState.CONTAINED,
        IncidentState.DRY_RUN,
        IncidentState.NEEDS_ATTENTION,
        IncidentState.FAILED,
        IncidentState.ABORTED,
        IncidentState.RELEASED,
    }
)

S = IncidentState
# The forward path. FAILED, NEEDS_ATTENTION and ABORTED are reachable from every
# non-terminal state (a step failed; a safe stop; an operator); they are added below.
ALLOWED: dict[IncidentState, frozenset[IncidentState]] = {
    S.RECORDED: frozenset({S.RESOLVED}),
    S.RESOLVED: frozenset({S.GUARDED, S.DRY_RUN}),
    S.GUARDED: frozenset({S.SUSPENDED, S.DRY_RUN}),
    S.SUSPENDED: frozenset({S.CORDONED}),
    S.CORDONED: frozenset({S.EVIDENCE_COLLECTED}),
    S.EVIDENCE_COLLECTED: frozenset({S.AWAITING_APPROVAL, S.CONTAINED}),
    S.AWAITING_APPROVAL: frozenset({S.APPROVED, S.REJECTED}),
    S.APPROVED: frozenset({S.REPLACING}),
    S.REJECTED: frozenset({S.FALSE_ALARM}),
    S.REPLACING: frozenset({S.REPLACED}),
    # A replacement that failed its qualification is replaced once more (REPLACED -> REPLACING).
    S.REPLACED: frozenset({S.POINTER_REWRITTEN, S.REPLACING}),
    S.POINTER_REWRITTEN: frozenset({S.RESUMED}),
    S.RESUMED: frozenset({S.CLOSED}),
}
ALLOWED = {
    state: nexts | {S.FAILED, S.NEEDS_ATTENTION, S.ABORTED} for state, nexts in ALLOWED.items()
}
for _terminal in _TERMINAL:
    ALLOWED[_terminal] = frozenset()
# The machine is done with these, but they may hold nodes for a human: an operator releases them.
for _held in (S.NEEDS_ATTENTION, S.CONTAINED, S.FAILED):
    ALLOWED[_held] = frozenset({S.RELEASED})


class Transition(Strict):
    """One recorded state change."""

    state: IncidentState
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    actor: Annotated[str, Field(min_length=1, max_length=256)]
    """Who moved it: a handler name, or a reviewer's identity."""
    note: Text = ""


class ResolvedSuspect(Strict):
    """A suspect rank traced down to its EC2 instance."""

    global_rank: Rank
    pod: Name
    node: Name
    instance_id: InstanceId
    instance_group: Annotated[str, Field(max_length=256)] = ""


class Decision(Strict):
    """A reviewer's answer to the approval request."""

    decision: Literal["approve", "reject"]
    reviewer: Annotated[str, Field(min_length=1, max_length=512)]
    reason: Annotated[str, Field(min_length=1, max_length=1024)]
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    execution_arn: Annotated[str, Field(max_length=2048)] | None = None
    """The decide machine's execution that delivered the decision, as Step Functions reports it
    (``$$.Execution.Id``): CloudTrail's StartExecution event for it names the caller who started it."""


class Earlier(Strict):
    """The incident that an incident repeats: the same fault (same job, run, nodes and window), alarming
    again after that one had ended."""

    incident_id: Annotated[str, Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
    state: IncidentState
    """How it ended."""
    ended_at: datetime
    decided_by: Annotated[str, Field(max_length=512)] | None = None
    """The reviewer who decided it, if one did."""

    def describe(self) -> str:
        """``repeat of sdc-…, rejected by … at …`` (or how else it ended)."""
        how = {
            IncidentState.FALSE_ALARM: "rejected",
            IncidentState.CLOSED: "approved (replaced)",
            IncidentState.CONTAINED: "contained",
            IncidentState.DRY_RUN: "dry run",
            IncidentState.NEEDS_ATTENTION: "stopped for attention",
            IncidentState.FAILED: "failed",
        }.get(self.state, self.state.value)
        by = f" by {self.decided_by}" if self.decided_by else ""
        return f"repeat of {self.incident_id}, {how}{by} at {self.ended_at.isoformat(timespec='seconds')}"


class RollbackPlan(Strict):
    """What approving does to the job's training progress, computed before the reviewers are asked."""

    pointer_from: Annotated[str, Field(max_length=1024)] | None
    """The checkpoint the resume pointer names now (None: no pointer yet)."""
    to: Annotated[str, Field(max_length=1024)]
    """The checkpoint the pointer will name: the newest verified one before the suspect window."""
    to_step: Step
    alarm_step: Step
    """The step the job had reached when it alarmed."""

    @property
    def steps_lost(self) -> int:
        """Steps the job trains again: from the checkpoint back to where it alarmed."""
        return max(0, self.alarm_step - self.to_step)

    def describe(self) -> str:
        """``pointer step-X → step-Y, N steps lost``."""
        start = self.pointer_from.rsplit("/", 1)[-1] if self.pointer_from else "(none)"
        return (
            f"pointer {start} \u2192 {self.to.rsplit('/', 1)[-1]}, {self.steps_lost} steps lost "
            f"(the job alarmed at step {self.alarm_step})"
        )


class Failure(Strict):
    """Where and why an incident failed."""

    state: Annotated[str, Field(max_length=128)]
    error: Annotated[str, Field(max_length=256)]
    cause: Annotated[str, Field(max_length=4096)] = ""


REPLACEMENT_REJECTED: Final = "Rejected"
"""A :class:`Replacement`'s status once its new node failed its qualification: cordoned, never resumed onto."""


class Replacement(Strict):
    """One instance's replacement."""

    old_instance_id: InstanceId
    new_instance_id: InstanceId | None = None
    status: Annotated[str, Field(max_length=64)] = "Requested"
    """Requested, Running, or :data:`REPLACEMENT_REJECTED`."""
    present_before: list[InstanceId] = Field(default_factory=list, max_length=10_000)
    """The instances of the old one's instance group that HyperPod listed just before the replacement was asked
    for: none of them is its successor (a node launched around the request by something else is never taken for
    the new one)."""


NodeCheckState = Literal["running", "passed", "failed", "skipped", "inconclusive"]
"""What replaying the capsule on a node said about the node: passed (every repetition gave the healthy bits),
failed (one or more did not), skipped (not run, e.g. no capsule), inconclusive (run, but no answer: the capsule
was unusable there, the Job hit its deadline or left no report)."""


class NodeCheck(Strict):
    """One replay of a capsule on one node, as a Kubernetes Job: the suspect's reproduction before approval, or a
    replacement's qualification before the job resumes onto it."""

    purpose: Literal["reproduce", "qualify"]
    node: Name
    instance_id: InstanceId | None = None
    job: Annotated[str, Field(max_length=63)] = ""
    """The Kubernetes Job's name (empty when none was created)."""
    capsule: Annotated[str, Field(max_length=1024)] = ""
    """Where the capsule replayed lives (``<checkpoint prefix>/capsules/step-...-rank-...``)."""
    repeats: Annotated[int, Field(ge=0, strict=True)] = 0
    state: NodeCheckState = "running"
    matched: Annotated[int, Field(ge=0, strict=True)] = 0
    """Repetitions that gave exactly the healthy bits."""
    reproduced: Annotated[int, Field(ge=0, strict=True)] = 0
    """Repetitions that did not: the fault reproduced."""
    summary: Text = ""
    """One line for the reviewers: ``reproduced 5/5: persistent``, ``qualified 5/5 on <node>``, ``not run: ...``."""
    started_at: datetime | None = None
    finished_at: datetime | None = None
    image: Annotated[str, Field(max_length=512)] = ""
    """The container image the Job ran (the stack's ``NodeCheckImage``, by digest): which software gave the answer."""
    job_uid: Annotated[str, Field(max_length=64)] = ""
    """The created Job's ``metadata.uid``: only pods it controls (on the checked node) are read."""

    @property
    def finished(self) -> bool:
        """Whether the check has its answer (or was never run)."""
        return self.state != "running"


class Incident(Strict):
    """One incident in the ledger."""

    schema_version: Literal["1"] = INCIDENT_SCHEMA_VERSION
    incident_id: Annotated[str, Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
    idempotency_key: Annotated[str, Field(min_length=1, max_length=512)]
    state: IncidentState = IncidentState.RECORDED
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    alarm: Alarm
    duplicate_alarms: Annotated[int, Field(ge=0, strict=True)] = 0
    """Further alarms that collapsed into this incident."""
    suspects: list[ResolvedSuspect] = []
    mode: Literal["normal", "dry_run", "cordon_only"] = "normal"
    evidence: dict[str, object] = {}
    """The evidence summary collected from CloudWatch (see the evidence handler)."""
    approval_requested_at: datetime | None = None
    decision: Decision | None = None
    replacements: list[Replacement] = []
    checkpoint_before: Annotated[str, Field(max_length=1024)] | None = None
    checkpoint_after: Annotated[str, Field(max_length=1024)] | None = None
    resumed_from_step: Step | None = None
    failure: Failure | None = None
    opened_by: Annotated[str, Field(max_length=2048)] | None = None
    """The incident machine's execution that opened the incident: a retried ``record`` of that execution
    recognises its own write instead of counting itself as a duplicate."""
    nodes_released_at: datetime | None = None
    """For an incident that stopped with nodes quarantined (NEEDS_ATTENTION, CONTAINED, FAILED): when the
    guard found none of them quarantined any more (released by a human, or gone); from then on they no
    longer count toward the blast radius."""
    rollback: RollbackPlan | None = None
    """What approving will roll the job back to, computed before the reviewers were asked."""
    repeat_of: Earlier | None = None
    """The ended incident this one repeats: the same fault alarmed again after it had ended (a reviewer
    rejected it, it was replaced, it stopped); it is a new incident, and the reviewers are told so."""
    job_uid: Annotated[str, Field(max_length=128)] | None = None
    """The PyTorchJob's ``metadata.uid`` when ``resolve`` confirmed the suspects' pods belong to it."""
    node_checks: list[NodeCheck] = []
    """The capsule replays on nodes (reproduction on the suspects, qualification of their replacements), one per
    purpose and node, newest result in place."""
    node_check_nonces: Annotated[
        dict[Annotated[str, Field(max_length=63)], Annotated[str, Field(max_length=64)]], Field(max_length=256)
    ] = {}
    """By node check Job name: the nonce written here before the Job is created, which the Job carries (annotation
    ``sdcguard.io/nonce``). A Job of that name that exists already is adopted only when it carries it: one made
    by someone else first is not."""
    notified: list[Annotated[str, Field(max_length=64)]] = []
    """The notifications sent, by what they announced (a state's name): a retried end sends what is missing."""
    transitions: list[Transition] = []

    @property
    def instance_ids(self) -> list[str]:
        """The suspect instances, sorted and de-duplicated."""
        return sorted({s.instance_id for s in self.suspects})

    def advance(self, state: IncidentState, *, actor: str, note: str = "", **changes: object) -> Incident:
        """A copy of this incident moved to ``state``, with the transition recorded.

        ``changes`` set other fields in the same step. Moving to the state the
        incident is already in is a no-op that returns ``self`` (a retried
        handler does no second thing). Raises :class:`IllegalTransition` when
        the lifecycle does not allow the move.
        """
        if state == self.state and not changes:
            return self
        if state != self.state and state not in ALLOWED[self.state]:
            raise IllegalTransition(f"incident {self.incident_id}: {self.state} -> {state} is not allowed")
        now = datetime.now(UTC)
        transitions = self.transitions
        if state != self.state:
            transitions = [*transitions, Transition(state=state, at=now, actor=actor, note=note)]
        data = self.model_dump()
        data.update(changes)
        data.update(state=state, updated_at=now, transitions=transitions)
        return Incident.model_validate(data)

    def entered(self, state: IncidentState) -> datetime | None:
        """When the incident first entered ``state``, or None."""
        return next((t.at for t in self.transitions if t.state == state), None)


__all__ = [
    "ALLOWED",
    "Decision",
    "Earlier",
    "Failure",
    "IllegalTransition",
    "Incident",
    "IncidentState",
    "InstanceId",
    "NodeCheck",
    "NodeCheckState",
    "REPLACEMENT_REJECTED",
    "Replacement",
    "ResolvedSuspect",
    "RollbackPlan",
    "Step",
    "Transition",
]
