"""The contract between the agent and the pipeline: alarm, checkpoint manifest,
resume pointer and incident record.

Depends on pydantic alone, so the training image needs no Lambda code and the
Lambda package needs no torch.
"""

from __future__ import annotations

from contract.alarm import (
    ALARM_SCHEMA_VERSION,
    DETAIL_TYPE,
    EVENT_SOURCE,
    Alarm,
    Detector,
    FingerprintEvidence,
    FingerprintGroup,
    JobIdentity,
    LastClean,
    NonFiniteBucket,
    NonFiniteEvidence,
    ProductCheckEvidence,
    ProductSite,
    RingAuditEvidence,
    RingPair,
    Suspect,
)
from contract.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    POINTER_NAME,
    CheckpointManifest,
    ObjectDigest,
    PointerEntry,
    ResumePointer,
    checkpoint_dir,
    step_of_dir,
)
from contract.incident import (
    Decision,
    Earlier,
    Failure,
    IllegalTransition,
    Incident,
    IncidentState,
    Replacement,
    ResolvedSuspect,
    RollbackPlan,
    Transition,
)

__all__ = [
    "ALARM_SCHEMA_VERSION",
    "CHECKPOINTS_DIR",
    "DETAIL_TYPE",
    "EVENT_SOURCE",
    "MANIFEST_NAME",
    "POINTER_NAME",
    "Alarm",
    "CheckpointManifest",
    "Decision",
    "Detector",
    "Failure",
    "FingerprintEvidence",
    "FingerprintGroup",
    "IllegalTransition",
    "Earlier",
    "Incident",
    "IncidentState",
    "JobIdentity",
    "LastClean",
    "NonFiniteBucket",
    "NonFiniteEvidence",
    "ObjectDigest",
    "PointerEntry",
    "ProductCheckEvidence",
    "ProductSite",
    "Replacement",
    "ResolvedSuspect",
    "RollbackPlan",
    "ResumePointer",
    "RingAuditEvidence",
    "RingPair",
    "Suspect",
    "Transition",
    "checkpoint_dir",
    "step_of_dir",
]
