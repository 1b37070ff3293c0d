"""Named exceptions of the incident pipeline.

The state machine ``Catch``es them by name: a Lambda failure's error name is
the exception's class name, so these names are part of the ASL and must not be
renamed casually.
"""

from __future__ import annotations

from sdcguard.lineage.errors import NoSafeCheckpoint


class PipelineError(Exception):
    """Base of every error the state machine catches by name."""


class MalformedEvent(PipelineError):
    """The input is not what the handler accepts (a malformed alarm, a missing field)."""


class IncidentNotFound(PipelineError):
    """The ledger holds no incident with this id."""


class SuspectUnresolvable(PipelineError):
    """A suspect rank cannot be traced to an EC2 instance (or the alarm names none)."""


class SuspectMismatch(PipelineError):
    """What the alarm says about a suspect is not what the cluster says: its pod does not exist, is not
    of the alarm's job, or runs on another node than the alarm names. Nothing is touched."""


class SuspectNotOperatorPod(PipelineError):
    """The suspect's pod is not the one the training operator made for the alarm's rank: another name or
    replica index than the rank's, not ``Running``, or its ``status.hostIP`` none of its node's addresses (a pod
    a tenant created with the job's label, owner and ``spec.nodeName``). Nothing is touched."""


class NotInCluster(PipelineError):
    """An instance or an alarm that does not belong to the cluster this pipeline guards."""


class BlastRadiusExceeded(PipelineError):
    """Acting would quarantine or replace more nodes than the configured limits allow."""


class IncidentNotWaiting(PipelineError):
    """A decision for an incident that is not waiting for approval."""


class UnknownDecision(PipelineError):
    """A decision other than ``approve`` or ``reject``."""


class UnverifiedDecision(PipelineError):
    """A decision that no running execution of the decide machine was started for (a direct invocation of the
    decide function, a made-up or finished execution): nothing changes."""


class StaleAlarm(PipelineError):
    """An alarm older than the configured age, or from a run of the job that is no longer the current one:
    it stops for attention and nothing is touched."""


class AlarmFromTheFuture(PipelineError):
    """An alarm dated later than the pipeline's own clock allows (beyond the clock-skew allowance): it could
    choose the evidence's window itself, so it is refused at record and nothing is written or touched."""


class UnsafeResume(PipelineError):
    """An operator's ``--resume-from`` that is not a verified checkpoint before the suspect window (or an
    incident with nothing to check it against): nothing changes."""


class ApprovalExpired(PipelineError):
    """The approval's task token timed out or no longer exists: the decision was not delivered."""


class ReplacementFailed(PipelineError):
    """HyperPod refused or failed the replacement of an instance."""


class NodeHeldByHyperPod(PipelineError):
    """``InstanceIdInUse``: HyperPod's own recovery is acting on the node."""


class ReplacementTimedOut(PipelineError):
    """The replacement did not reach Running within the bound of the wait loop."""


class PointerOutsidePrefix(PipelineError):
    """The alarm's checkpoint prefix is not exactly the bucket and prefix this pipeline guards."""


class TransientKubernetesError(PipelineError):
    """The Kubernetes API failed in a way worth retrying (5xx, 429, connection errors)."""


class KubernetesObjectMissing(PipelineError):
    """A node, pod or PyTorchJob the incident names does not exist."""


class LedgerConflict(PipelineError):
    """The ledger item kept changing under us (or the guard lost its cluster lock): the write was not made."""


class LockLost(LedgerConflict):
    """The guard's cluster lock expired and was taken over before the guard wrote: nothing was written."""


class Throttled(PipelineError):
    """An AWS API kept throttling after the client's own retries; the call took no effect, retrying is safe."""


__all__ = [
    "ApprovalExpired",
    "BlastRadiusExceeded",
    "IncidentNotFound",
    "IncidentNotWaiting",
    "KubernetesObjectMissing",
    "LedgerConflict",
    "LockLost",
    "MalformedEvent",
    "NoSafeCheckpoint",
    "NodeHeldByHyperPod",
    "NotInCluster",
    "PipelineError",
    "PointerOutsidePrefix",
    "ReplacementFailed",
    "ReplacementTimedOut",
    "SuspectMismatch",
    "SuspectNotOperatorPod",
    "SuspectUnresolvable",
    "Throttled",
    "TransientKubernetesError",
    "UnknownDecision",
]
