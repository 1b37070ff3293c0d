"""The seam between the guard's one step and the way the job is parallelised (DDP, or FSDP2 on a mesh).

:class:`sdcguard.agent.guard.SDCGuard` runs the same step, the same verdicts and the
same decisions for every parallelism; a :class:`Parallelism` answers what
differs: the rank's own forward and backward (and what its gradient observer
saw), a recomputation of another rank's work and the claim it makes, the audit
records, the vote groups (who must hold the same bits as whom), the state
detector 3 fingerprints, the checkpoint writer, the injection site and how
an alarm labels a digest. The DDP one is sdcguard.agent.data_parallel, the FSDP2 one
sdcguard.agent.sharded.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from sdcguard.agent import replay
from sdcguard.agent.batches import micro_batches
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.confirm import Ring
from sdcguard.agent.findings import StepFindings
from sdcguard.agent.topology import Topology
from sdcguard.agent.weights import GroupVerdict

if TYPE_CHECKING:
    from sdcguard.agent.checkpoint import LoadedCheckpoint, SaveResult

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
BatchFor = Callable[[int, int], Any]


class Checkpoints(Protocol):
    """What the guard asks of a checkpoint writer (sdcguard.agent.checkpoint's, or sdcguard.agent.sharded_checkpoint's)."""

    def save(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             fingerprint: str, data_position: Any = None, extra: dict[str, Any] | None = None,
             last_clean_audit_step: int | None = None,
             last_clean_fingerprint_step: int | None = None) -> SaveResult: ...

    def load(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             fingerprint_fn: Callable[[], str] | None = None) -> LoadedCheckpoint | None: ...


@dataclass(frozen=True)
class InjectionSite:
    """What ``sdcguard.agent.testing.inject.Injector.install`` reaches for: the model as DDP shows it (``model.module`` is the
    bare module), the optimizer, the gradient observer (``after_reduce``, under FSDP2 ``before_reduce``
    observers) and the guard's per-step hooks."""

    model: Any
    optimizer: torch.optim.Optimizer
    hook: Any
    register_step_hook: Callable[[Callable[[int], None]], None]


@dataclass
class Job:
    """What the user handed the guard about the work itself, the same under every parallelism."""

    config: GuardConfig
    loss_fn: LossFn
    batch_for: BatchFor
    topology: Topology
    scaler: torch.amp.GradScaler | None

    def micro_batches(self, step: int, rank: int) -> list[Any]:
        """``batch_for(step, rank)`` as a list of K micro-batches (``sdcguard.agent.batches.micro_batches``: ValueError
        naming ``batch_for`` and what it must return when it returns something else)."""
        return micro_batches(self.batch_for, step, rank, self.config.grad_accum_steps)

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """How every forward the guard runs is run (the rank's own, and every recomputation compared with it bit
        for bit): under ``torch.autocast`` to ``autocast_dtype`` on ``device``'s type (when it is set), and with
        the product checks on, compiled code run eagerly (``sdcguard.agent.replay.autocast_and_stance``)."""
        return replay.autocast_and_stance(device, self.config.autocast_dtype, eager=self.config.product_checks)

    def forward(self, module: torch.nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        """``loss_fn`` under :meth:`forward_context`: every forward the guard runs."""
        with self.forward_context(device):
            return self.loss_fn(module, batch)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as the GradScaler scales it (unchanged without one)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss


class Parallelism(ABC):
    """How one step reaches the model under one way of parallelising it; built by the guard, used every step."""

    job: Job
    """The work itself (settings, loss, data, topology)."""
    model: Any
    """What ``loss_fn`` gets and the optimizer updates: the DDP or FSDP2 model."""
    params: list[torch.nn.Parameter]
    """The trainable parameters, in module order."""
    names: list[str]
    frozen_names: list[str]
    buffer_names: list[str]
    """Buffers the weight fingerprint covers."""
    device: torch.device
    group: Any
    """The process group of the guard's collectives (None: the default group)."""
    ring: Ring
    """Who confirms whom."""
    audit_stride: int
    """A rank audits ``(rank + audit_stride) mod world``."""
    audit_possible: bool
    """The audit and confirmations have a rank on another node (or replica) to recompute on."""
    audit_needs: str
    """What the audit needs when it is not possible (for the warning)."""
    replicated: bool
    """Some state is held by more than one rank, so detector 3 and the reduced-gradient comparison apply."""
    vote_groups: list[list[int]]
    """The ranks that must hold the same bits, group by group."""
    vote_slot: int
    """This rank's vote group."""
    collective_recompute: bool
    """A recomputation is a collective (FSDP2's forward all-gathers): every rank runs every slot in lock step."""

    @property
    def audits(self) -> int:
        """The rank whose micro-batch this rank recomputes on audit steps."""
        topo = self.job.topology
        return (topo.rank + self.audit_stride) % topo.world_size

    @property
    def audited_by(self) -> int:
        """The rank that recomputes this rank's micro-batch on audit steps."""
        topo = self.job.topology
        return (topo.rank - self.audit_stride) % topo.world_size

    @abstractmethod
    def install(self) -> None:
        """Install the gradient observer on the model (after the guard chose its deterministic settings)."""

    @abstractmethod
    def forward_backward(self, step: int, *, audited: bool) -> StepFindings:
        """The rank's own pass over its K micro-batches, the gradients reduced and observed; its findings."""

    @abstractmethod
    def own_claim(self, found: StepFindings, *, digests: bool) -> torch.Tensor:
        """This rank's claim about its own pass (sdcguard.agent.confirm's layout, int64 on the device)."""

    @abstractmethod
    def audit_records(self, step: int, found: StepFindings) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's own record, its recomputation of the rank it audits laid out the same way)."""

    @abstractmethod
    def recompute_claim(self, step: int, owner: int, *, digests: bool) -> torch.Tensor:
        """The claim ``owner`` should have made at ``step``, recomputed here; changes nothing."""

    @abstractmethod
    def digest_names(self) -> list[str]:
        """The names of the digest rows of this step's claims and audit records, in order."""

    @abstractmethod
    def local_norm(self, found: StepFindings) -> torch.Tensor:
        """This rank's local-gradient norm (what the magnitude trigger watches), 0-dim fp64 on the device."""

    @abstractmethod
    def reduced_norm(self) -> torch.Tensor | None:
        """The global norm of the reduced gradients when the observer measured it, else None."""

    @abstractmethod
    def state_lanes(self) -> torch.Tensor:
        """This rank's fingerprint lanes of what detector 3 compares within its vote group."""

    @abstractmethod
    def agreed_digest(self, verdict: GroupVerdict) -> str:
        """The one fingerprint of the state every group agreed on (a unanimous ``verdict``)."""

    @abstractmethod
    def state_fingerprint_hex(self) -> str:
        """The fingerprint a checkpoint's manifest records for the loaded state (checked after a load)."""

    @abstractmethod
    def local_fingerprint_hex(self) -> str:
        """This rank's own fingerprint of what detector 3 compares, as hex (no collective)."""

    @abstractmethod
    def checkpoint_writer(self, prefix: str, *, corrupt: Any, written_by: str) -> Checkpoints:
        """The job's checkpoint writer on ``prefix``."""

    @abstractmethod
    def injection_site(self, optimizer: torch.optim.Optimizer,
                       register_step_hook: Callable[[Callable[[int], None]], None]) -> InjectionSite:
        """Where a fault injector installs its hooks."""

    def param_label(self, name: str) -> str:
        """How an alarm names a digest that disagreed."""
        return name


def gather_rows(local: torch.Tensor, world_size: int, group: Any) -> torch.Tensor:
    """Every rank's ``local`` (the same shape everywhere) as ``[world, n]`` on the CPU: an all-gather, only on
    the disagreement path and for the weight check (a one-rank world needs none)."""
    if world_size == 1:
        return local.reshape(1, -1).cpu()
    out = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(out, local, group=group)
    return torch.stack(out).cpu()
