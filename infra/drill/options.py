"""What one drill injects and how its job runs: :class:`DrillOptions`, checked before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decision = Literal["approve", "reject", "ask"]

# The agent's injection kinds the drill offers, and the detector that should catch each.
EXPECTED_DETECTOR = {
    # The activation error moves the rank's loss: the magnitude trigger asks before the next audit.
    "finite_activation": "magnitude_trigger",
    "nan_activation": "nonfinite_grad",
    "weight_bitflip": "weight_fingerprint",
    "grad_bitflip": "ring_audit",
}
FAULTS = tuple(EXPECTED_DETECTOR)
CAPSULE_FAULTS = ("finite_activation", "nan_activation", "grad_bitflip")
"""The faults whose alarm comes from a recomputation, so the agent leaves a replay capsule of the suspect's step
(the weight comparison recomputes nothing): the ones whose node the pipeline can test by replaying it."""
SHARDINGS = ("ddp", "hsdp")
"""How the drill's job holds its weights: DDP, or FSDP2 with one replica group per node (``sdcguard.agent.testing.train``'s)."""
REVIEWER_REASON = "sdcguard drill: ring audit evidence reviewed"


@dataclass(frozen=True)
class DrillOptions:
    """What one drill injects and how the job runs. ``validate`` raises ValueError naming the option."""

    fault: str = "finite_activation"
    fault_rank: int = 3
    fault_step: int = 33
    steps: int = 60
    decision: Decision = "approve"
    audit_every: int = 10
    fingerprint_every: int = 5
    checkpoint_every: int = 10
    nodes: int = 3
    ranks_per_node: int = 2
    seed: int = 0
    reason: str = REVIEWER_REASON
    chaos: float = 0.0
    """The fraction of the pipeline's Kubernetes API and SageMaker HyperPod calls that fail transiently."""
    chaos_seed: int = 0
    """Which calls fail: the same seed fails the same calls (the n-th of each operation)."""
    sharding: str = "ddp"
    """One of SHARDINGS; under hsdp each node holds one replica of the model, sharded over its ranks."""
    replacement_faulty: bool = False
    """The stand-in hands out replacements of the faulty node with the same fault: the job must not resume onto one."""

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.nodes * self.ranks_per_node

    def expected_alarm_step(self) -> int:
        """The step at which the agent should raise the alarm for this fault."""
        if self.fault == "nan_activation":
            return self.fault_step  # the non-finite check runs on every step
        if self.fault == "weight_bitflip":
            # The flip lands after the fault step's update; the next weight comparison
            # (a fingerprint step, or the check before a checkpoint save) sees it.
            cadences = [c for c in (self.fingerprint_every, self.checkpoint_every) if c]
            return min((self.fault_step // c + 1) * c for c in cadences)
        return math.ceil(self.fault_step / self.audit_every) * self.audit_every

    def validate(self) -> None:
        """Refuse options the drill cannot play out, naming the option and why."""
        if self.fault not in FAULTS:
            raise ValueError(f"--fault: {self.fault!r} is not one of {', '.join(FAULTS)}")
        if self.nodes < 3:
            raise ValueError(f"nodes: the ring audit localises a node only with 3 or more nodes, got {self.nodes}")
        if not 0 <= self.fault_rank < self.world_size:
            raise ValueError(f"--fault-rank: must be a rank from 0 to {self.world_size - 1}, got {self.fault_rank}")
        for name in ("audit_every", "fingerprint_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.fault_step <= self.checkpoint_every:
            raise ValueError(
                f"--fault-step: must be after the first checkpoint (step {self.checkpoint_every}) so that a clean "
                f"checkpoint exists to resume from, got {self.fault_step}"
            )
        alarm = self.expected_alarm_step()
        if alarm >= self.steps:
            raise ValueError(
                f"--steps: the {self.fault} fault at step {self.fault_step} is first checked at step {alarm}; "
                f"give --steps above {alarm} (got {self.steps})"
            )
        if self.decision not in ("approve", "reject", "ask"):
            raise ValueError(f"decision: must be approve, reject or ask, got {self.decision!r}")
        if not 0 <= self.chaos < 1:
            raise ValueError(f"--chaos: must be a fraction of calls from 0 up to (not including) 1, got {self.chaos}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"--sharding: must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.replacement_faulty and self.decision == "reject":
            raise ValueError("--replacement-faulty: a rejected incident replaces no node; drop --reject")
        if self.replacement_faulty and not self.leaves_capsule:
            # Without a capsule no replacement can be qualified, and the pipeline resumes onto it as it says.
            raise ValueError(f"--replacement-faulty: the {self.fault} alarm leaves no replay capsule to qualify a "
                             f"replacement with; use --fault {', '.join(CAPSULE_FAULTS)}")

    @property
    def leaves_capsule(self) -> bool:
        """The alarm for this fault comes from a recomputation: the agent writes a replay capsule of the suspect."""
        return self.fault in CAPSULE_FAULTS

    @property
    def persistent(self) -> bool:
        """The fault corrupts every computation of its GPU until the hardware goes (``repeat`` > 1)."""
        return self.fault != "weight_bitflip"

    def injection(self, node_name: str) -> str:
        """``SDCGUARD_INJECT`` for the faulty rank, bound to its node: it fires nowhere else.

        The drill registers the same spec with the stand-in as the node's
        hardware fault, so a replay Job on that node meets it too."""
        # A weight flip toggles the bit on every step it fires, so it fires once; the
        # others stay on, as a broken GPU does, until the hardware is replaced.
        repeat = self.steps if self.persistent else 1
        return f"kind={self.fault},node={node_name},step={self.fault_step},repeat={repeat}"
