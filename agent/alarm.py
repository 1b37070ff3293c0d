"""Building the contract's Alarm from a detector's verdict and the job's identity."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.topology import Topology
from sdcguard.contract import (
    Alarm,
    Detector,
    FingerprintEvidence,
    FingerprintGroup,
    JobIdentity,
    LastClean,
    NonFiniteBucket,
    NonFiniteEvidence,
    RingAuditEvidence,
    RingPair,
    Suspect,
)
from sdcguard.contract.alarm import MAX_SUSPECTS, FaultPersistence
from sdcguard.contract.checkpoint import POINTER_NAME

# Fixed width of one rank's identity on the wire (three names of <= 253 bytes and JSON).
IDENTITY_BYTES = 1024


@dataclass(frozen=True)
class RankIdentity:
    """The names that locate one rank's hardware."""

    global_rank: int
    local_rank: int
    pod: str
    node: str
    host: str

    @classmethod
    def of(cls, topology: Topology) -> RankIdentity:
        """This rank's identity from its topology (names truncated to the contract's 253 characters)."""
        return cls(topology.rank, topology.local_rank, topology.pod[:253], topology.node[:253], topology.host[:253])

    def suspect(self) -> Suspect:
        """As the contract's Suspect."""
        return Suspect(**asdict(self))


def gather_identities(topology: Topology, device: torch.device,
                      group: dist.ProcessGroup | None = None) -> list[RankIdentity]:
    """Every rank's identity, on every rank: one all-gather of fixed-width int64 byte vectors.

    (``all_gather_object`` would need numpy; int64 tensors need nothing.)
    """
    mine = json.dumps(asdict(RankIdentity.of(topology))).encode()
    if len(mine) > IDENTITY_BYTES:
        raise ValueError(f"NODE_NAME/POD_NAME/HOSTNAME: identity of rank {topology.rank} exceeds {IDENTITY_BYTES} bytes")
    local = torch.zeros(IDENTITY_BYTES, dtype=torch.int64, device="cpu")
    local[: len(mine)] = torch.tensor(list(mine), dtype=torch.int64, device="cpu")
    if not dist.is_initialized() or topology.world_size == 1:
        return [RankIdentity.of(topology)]
    local = local.to(device)
    out = [torch.zeros_like(local) for _ in range(topology.world_size)]
    dist.all_gather(out, local, group=group)
    identities = []
    for row in out:
        data = bytes(v for v in row.cpu().tolist() if v)
        identities.append(RankIdentity(**json.loads(data)))
    return identities


def job_identity(config: GuardConfig) -> JobIdentity:
    """The job's identity from the configuration."""
    return JobIdentity(hyperpod_cluster=config.hyperpod_cluster, eks_cluster=config.eks_cluster,
                       namespace=config.namespace[:63], job_name=config.job_name)


def resume_pointer_location(prefix: str) -> str:
    """Where RESUME.json lives under the checkpoint prefix."""
    return f"{prefix.rstrip('/')}/{POINTER_NAME}"


def nonfinite_evidence(local_ranks: Sequence[int], reduced_nonfinite: bool,
                       buckets: Sequence[tuple[int, int, str]]) -> NonFiniteEvidence:
    """Detector 1's evidence."""
    return NonFiniteEvidence(
        local_ranks=list(local_ranks)[:MAX_SUSPECTS],
        reduced_nonfinite=reduced_nonfinite,
        buckets=[NonFiniteBucket(rank=r, bucket=b, phase=phase) for r, b, phase in buckets],
    )


def ring_evidence(pairs: Sequence[RingPair]) -> RingAuditEvidence:
    """Detector 2's evidence: the pairs that disagreed (all pairs when that would be empty)."""
    return RingAuditEvidence(pairs=list(pairs))


def fingerprint_evidence(kind: str, groups: Sequence[tuple[str, list[int]]], majority: str | None,
                         scope: str) -> FingerprintEvidence:
    """Detector 3's (or the reduced-gradient comparison's) evidence: who held which fingerprint."""
    return FingerprintEvidence(
        kind=kind,
        groups=[FingerprintGroup(fingerprint=h, ranks=ranks) for h, ranks in groups],
        majority=majority,
        scope=scope,
    )


def publisher_rank(world_size: int, suspects: Sequence[int]) -> int:
    """The lowest-ranked rank that is not a suspect (rank 0 when every rank is one)."""
    blamed = set(suspects)
    return next((r for r in range(world_size) if r not in blamed), 0)


def build_alarm(
    *,
    alarm_id: str,
    config: GuardConfig,
    topology: Topology,
    identities: Sequence[RankIdentity],
    detector: Detector,
    step: int,
    suspects: Sequence[int],
    localized: bool,
    evidence: NonFiniteEvidence | RingAuditEvidence | FingerprintEvidence,
    last_clean: LastClean,
    message: str,
    fault_persistence: FaultPersistence = "unknown",
) -> Alarm:
    """The contract Alarm; ``pydantic.ValidationError`` (naming the field) if something does not fit it."""
    return Alarm(
        alarm_id=alarm_id,
        job=job_identity(config),
        detector=detector,
        step=step,
        world_size=topology.world_size,
        ranks_per_node=topology.ranks_per_node,
        suspects=[identities[r].suspect() for r in sorted(set(suspects))],
        localized=localized,
        evidence=evidence,
        last_clean=last_clean,
        checkpoint_prefix=config.checkpoint_prefix,
        resume_pointer=resume_pointer_location(config.checkpoint_prefix),
        publisher_rank=publisher_rank(topology.world_size, suspects),
        message=message[:1024],
        fault_persistence=fault_persistence,
    )
