"""The alarm: what a training rank tells the pipeline when a detector fires.

It travels as the ``detail`` of an EventBridge event with source
:data:`EVENT_SOURCE` and detail-type :data:`DETAIL_TYPE`. Both the agent (which
builds it) and the Lambda handlers (which parse it) import this module; it
depends on pydantic alone.
"""

from __future__ import annotations

import enum
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

ALARM_SCHEMA_VERSION: Final = "1"
EVENT_SOURCE = "sdcguard.agent"
DETAIL_TYPE = "SDC Alarm"

# Kubernetes object names are DNS subdomains (253 characters at most); host
# names are bounded the same way. Free text is bounded so that an alarm always
# fits in one EventBridge entry (256 KiB) and one DynamoDB item (400 KiB).
Name = Annotated[str, Field(min_length=1, max_length=253)]
Text = Annotated[str, Field(max_length=1024)]
# Integers are strict, as the JSON Schema says: pydantic's lax mode would take
# ``true`` for 1 and ``"7"`` for 7, so what the pipeline acts on would differ
# from what a schema-checking reader of the same event sees.
Step = Annotated[int, Field(ge=0, strict=True)]
Rank = Annotated[int, Field(ge=0, strict=True)]
Fingerprint = Annotated[str, Field(pattern=r"^[0-9a-f]{16,128}$")]

MAX_SUSPECTS = 1024
MAX_EVIDENCE_ITEMS = 4096

FaultPersistence = Literal["persistent", "transient", "unknown"]
"""Whether the faulty hardware got the same computation wrong again when it replayed it once."""


class Strict(BaseModel):
    """Base for every contract model: unknown fields are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)


class Detector(enum.StrEnum):
    """Which check fired."""

    NONFINITE_GRAD = "nonfinite_grad"
    """A NaN/Inf in a local (pre-all-reduce) or reduced gradient."""
    RING_AUDIT = "ring_audit"
    """Another node recomputed a rank's micro-batch and got different bits."""
    WEIGHT_FINGERPRINT = "weight_fingerprint"
    """Replicas hold different weights or optimizer state."""
    REDUCED_GRAD = "reduced_grad"
    """The all-reduce delivered different gradients to different ranks."""
    PRODUCT_CHECK = "product_check"
    """A matrix product's checksums did not match (``GuardConfig.product_checks``), and other nodes'
    recomputations of the micro-batch disagree with the rank's own pass."""
    MAGNITUDE_TRIGGER = "magnitude_trigger"
    """A rank's loss or gradient norm jumped (the magnitude trigger, or the cross-rank test of a fresh job's
    first steps), and other nodes' recomputations of its micro-batch disagree. Older agents reported this as
    ``ring_audit`` with ``evidence.trigger == "magnitude"``."""


class JobIdentity(Strict):
    """Where the training job runs."""

    hyperpod_cluster: Name
    eks_cluster: Name
    namespace: Annotated[str, Field(min_length=1, max_length=63)]
    job_name: Name


class Suspect(Strict):
    """One rank the detector blames, with everything needed to find its hardware."""

    global_rank: Rank
    local_rank: Rank
    pod: Name
    node: Name
    host: Name


class NonFiniteBucket(Strict):
    """One gradient bucket that held a NaN or an infinity."""

    rank: Rank
    bucket: Annotated[int, Field(ge=0, strict=True)]
    phase: Literal["local", "reduced"]


class NonFiniteEvidence(Strict):
    """Detector 1: which ranks produced non-finite local gradients."""

    kind: Literal["nonfinite_grad"] = "nonfinite_grad"
    local_ranks: Annotated[list[Rank], Field(max_length=MAX_SUSPECTS)]
    """Ranks whose own (pre-reduce) gradients were non-finite."""
    reduced_nonfinite: bool
    """Whether the all-reduced gradients were non-finite (the update is blocked)."""
    buckets: Annotated[list[NonFiniteBucket], Field(max_length=MAX_EVIDENCE_ITEMS)] = []
    confirmation: Annotated[list[RingPair], Field(max_length=MAX_EVIDENCE_ITEMS)] = []
    """Recomputations of the non-finite ranks' micro-batches on other nodes in the same step (auditor: the
    confirming rank); one that did not reproduce the NaN/Inf is what makes this a hardware alarm."""


class RingPair(Strict):
    """One audit: ``auditor`` recomputed the micro-batch of ``audited``."""

    auditor: Rank
    audited: Rank
    loss_match: bool
    expected_loss: Annotated[str, Field(max_length=64)]
    """The audited rank's own loss, as a float hex string (exact bits)."""
    observed_loss: Annotated[str, Field(max_length=64)]
    """The auditor's recomputed loss, as a float hex string."""
    mismatched_params: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=64)] = []
    """Names of parameters whose local-gradient fingerprints differed (first 64)."""


class RingAuditEvidence(Strict):
    """Detector 2: the ring pairs of the audit step."""

    kind: Literal["ring_audit", "magnitude_trigger"] = "ring_audit"
    """``magnitude_trigger`` when the magnitude trigger asked for the recomputation (detector
    ``magnitude_trigger``)."""
    pairs: Annotated[list[RingPair], Field(min_length=1, max_length=MAX_EVIDENCE_ITEMS)]
    """The recomputations that disagreed: the audit's pairs, or (trigger "magnitude") the confirmations'."""
    trigger: Literal["audit", "magnitude"] = "audit"
    """What asked for the recomputation: a scheduled audit step, or the magnitude trigger on any step."""
    confirmation: Annotated[list[RingPair], Field(max_length=MAX_EVIDENCE_ITEMS)] = []
    """Every confirmation recomputation of the step (other nodes recomputing the suspicious micro-batches)."""


class ProductSite(Strict):
    """One matrix product whose checksums did not match."""

    rank: Rank
    site: Annotated[str, Field(min_length=1, max_length=256)]
    """The product: the module's name and the direction (``"blocks.0.qkv forward"``, ``"... backward dW"``)."""


class ProductCheckEvidence(Strict):
    """Product checks: which rank's products failed their checksums, and the recomputations that judged it."""

    kind: Literal["product_check"] = "product_check"
    sites: Annotated[list[ProductSite], Field(min_length=1, max_length=MAX_EVIDENCE_ITEMS)]
    """The first failing product of each rank whose checks fired."""
    confirmation: Annotated[list[RingPair], Field(max_length=MAX_EVIDENCE_ITEMS)] = []
    """Other nodes' recomputations of those ranks' micro-batches in the same step (empty without confirmation)."""


class FingerprintGroup(Strict):
    """Ranks that hold the same fingerprint."""

    fingerprint: Fingerprint
    ranks: Annotated[list[Rank], Field(min_length=1, max_length=MAX_SUSPECTS)]


class FingerprintEvidence(Strict):
    """Detectors 3 and 4: which ranks held which fingerprint."""

    kind: Literal["weight_fingerprint", "reduced_grad"]
    groups: Annotated[list[FingerprintGroup], Field(min_length=1, max_length=MAX_SUSPECTS)]
    majority: Fingerprint | None
    """The fingerprint of a strict majority, or None: corrupted, not localised."""
    scope: Literal["weights", "optimizer", "weights+optimizer", "reduced_gradients"]


Evidence = Annotated[
    NonFiniteEvidence | RingAuditEvidence | FingerprintEvidence | ProductCheckEvidence,
    Field(discriminator="kind"),
]


class LastClean(Strict):
    """The last step at which each detector passed cleanly (None: never ran)."""

    nonfinite_grad: Step | None = None
    ring_audit: Step | None = None
    weight_fingerprint: Step | None = None
    reduced_grad: Step | None = None
    product_check: Step | None = None
    magnitude_trigger: Step | None = None


class Alarm(Strict):
    """The alarm contract (EventBridge ``detail``), schema version 1.

    Raises ``pydantic.ValidationError`` naming the field for an unknown schema
    version, a missing field, a wrong type, a negative step, a suspect outside
    the world, or an over-long string.
    """

    schema_version: Literal["1"] = ALARM_SCHEMA_VERSION
    alarm_id: Annotated[str, Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")] = Field(
        default_factory=lambda: uuid.uuid4().hex
    )
    time: datetime = Field(default_factory=lambda: datetime.now(UTC))
    job: JobIdentity
    detector: Detector
    step: Step
    world_size: Annotated[int, Field(ge=1, le=1_000_000, strict=True)]
    ranks_per_node: Annotated[int, Field(ge=1, le=1024, strict=True)]
    suspects: Annotated[list[Suspect], Field(max_length=MAX_SUSPECTS)]
    """Ranks blamed. Empty when the fault is real but not localised."""
    localized: bool
    """True when the detector could single out the suspects."""
    evidence: Evidence
    last_clean: LastClean
    checkpoint_prefix: Annotated[str, Field(min_length=1, max_length=1024)]
    """``s3://bucket/prefix`` (or a local directory) under which checkpoints live."""
    resume_pointer: Annotated[str, Field(min_length=1, max_length=1024)]
    """Location of ``RESUME.json``."""
    publisher_rank: Rank = 0
    message: Text = ""
    fault_persistence: FaultPersistence = "unknown"
    """After a confirmed mismatch the suspect replays its computation once: ``persistent`` when it got it
    wrong again, ``transient`` when it now agrees with the majority, ``unknown`` where no replay applies
    (weight and reduced-gradient comparisons, alarms that are not localised)."""

    @model_validator(mode="after")
    def _consistent(self) -> Alarm:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for i, suspect in enumerate(self.suspects):
            if suspect.global_rank >= self.world_size:
                problems.append(
                    (("suspects", i, "global_rank"), f"{suspect.global_rank} is outside the world of {self.world_size}")
                )
            if suspect.local_rank >= self.ranks_per_node:
                problems.append(
                    (("suspects", i, "local_rank"), f"{suspect.local_rank} is not below ranks_per_node {self.ranks_per_node}")
                )
        if self.world_size % self.ranks_per_node:
            problems.append((("ranks_per_node",), f"{self.ranks_per_node} does not divide world_size {self.world_size}"))
        if self.evidence.kind != self.detector.value:
            problems.append((("evidence", "kind"), f"{self.evidence.kind!r} does not match detector {self.detector.value!r}"))
        if self.publisher_rank >= self.world_size:
            problems.append((("publisher_rank",), f"{self.publisher_rank} is outside the world of {self.world_size}"))
        if self.localized and not self.suspects:
            problems.append((("suspects",), "a localised alarm must name at least one suspect"))
        if problems:
            raise _errors("Alarm", problems)
        return self

    @property
    def run_id(self) -> str | None:
        """The agent's run id (16 hex digits) that starts the alarm id of alarms the agent names, or None.

        The agent names its alarms ``<run id>-<step>-<detector>``, with one run
        id agreed by all ranks of one start of the job; an alarm id of any other
        form (older agents, hand-made alarms) has no run id.
        """
        match = _RUN_ID.match(self.alarm_id)
        return match.group(1) if match else None

    @property
    def suspect_ranks(self) -> list[int]:
        """Global ranks of the suspects, sorted."""
        return sorted(s.global_rank for s in self.suspects)

    @property
    def suspect_nodes(self) -> list[str]:
        """Kubernetes node names of the suspects, sorted and de-duplicated."""
        return sorted({s.node for s in self.suspects})

    def trusted_through_step(self) -> int:
        """The last step whose state is trusted: checkpoints at or before it qualify.

        A checkpoint's step is the first step a resumed job runs, so it holds
        the updates of steps ``0 .. step-1``. The fault is known to be absent
        at each detector's last clean step; a detector that runs on every step
        (non-finite, reduced gradients) caught the fault at once, but a finite
        corruption of the computation is only ruled out by a clean ring audit,
        and a divergence of replicas only by a clean weight check. When in
        doubt we take the earlier: the minimum over the alarm's own detector and
        the two sampled detectors that ran. Returns -1 when nothing was ever
        clean (no checkpoint qualifies).
        """
        own = getattr(self.last_clean, self.detector.value)
        # The per-step checks (the product checks and the magnitude trigger too) see the fault at its own step.
        if self.detector in (Detector.NONFINITE_GRAD, Detector.REDUCED_GRAD, Detector.PRODUCT_CHECK,
                             Detector.MAGNITUDE_TRIGGER):
            own = self.step
        candidates = [own if own is not None else -1]
        for sampled in (self.last_clean.ring_audit, self.last_clean.weight_fingerprint):
            if sampled is not None:
                candidates.append(sampled)
        return min(candidates)


_RUN_ID = re.compile(r"^([0-9a-f]{16})-")


def _errors(title: str, problems: list[tuple[tuple[str | int, ...], str]]) -> ValidationError:
    """A ValidationError whose entries carry the field's location, as field errors do."""
    details = [
        InitErrorDetails(type=PydanticCustomError("inconsistent", message), loc=loc, input=None)
        for loc, message in problems
    ]
    return ValidationError.from_exception_data(title, details)
