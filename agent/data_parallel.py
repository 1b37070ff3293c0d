"""DDP behind the guard's seam: the rank's pass through DistributedDataParallel, observed by the communication hook.

Every rank holds the whole model, so every rank is one vote group: the
reduced gradients and the weights must have the same bits on all of them.
The rank's own pass runs its K micro-batches through DDP (``no_sync`` for all
but the last), so the hook (sdcguard.agent.ddp_hook) sees the accumulated local
gradients before their all-reduce and checks them as they are reduced. A
recomputation runs another rank's micro-batches on the bare module
(sdcguard.agent.recompute), with no communication, and lays its gradients out as DDP's
buckets were, so its claim and audit record compare bit for bit with the
owner's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sdcguard.agent import confirm, replay
from sdcguard.agent.batches import batch_digest
from sdcguard.agent.checkpoint import CheckpointWriter
from sdcguard.agent.ddp_hook import GradientHook
from sdcguard.agent.findings import StepFindings
from sdcguard.agent.parallelism import Checkpoints, InjectionSite, Job, Parallelism
from sdcguard.agent.recompute import Recomputation, preserved, recompute_step
from sdcguard.agent.ring_audit import audit_record, layout_order, owner_record
from sdcguard.agent.weights import GroupVerdict, checked_buffers, state_fingerprint, state_fingerprint_hex


class DataParallel(Parallelism):
    """The guard's work on a ``torch.nn.parallel.DistributedDataParallel`` model.

    Raises ``ValueError`` naming ``model`` when it is not DDP-wrapped.
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, job: Job, *,
                 group: dist.ProcessGroup | None, unchecked_buffers: tuple[str, ...]) -> None:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("model: must be a torch.nn.parallel.DistributedDataParallel")
        topo = job.topology
        self.job = job
        self.model = model
        self.optimizer = optimizer
        self.group = group
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frozen_names = [n for n, p in model.module.named_parameters() if not p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.audit_stride = topo.ranks_per_node
        self.audit_possible = topo.nodes >= 2
        self.ring = confirm.Ring.of(topo.world_size, topo.ranks_per_node)
        self.replicated = True
        self.vote_groups = [list(range(topo.world_size))]
        self.vote_slot = 0
        self.collective_recompute = False
        self.audit_needs = "ranks on at least 2 nodes"
        self.unchecked_buffers = set(unchecked_buffers)
        self.buffer_names: list[str] = []
        self.hook = GradientHook({id(p): n for n, p in named}, topo.world_size, group)
        self.own_batches: list[Any] = []
        """The micro-batches of this step's own pass (references: digested only when a claim is made)."""

    def install(self) -> None:
        """Settle DDP's buckets (:func:`settle_buckets`), choose the checked buffers, then install the hook."""
        cfg, topo, model, job = self.job.config, self.job.topology, self.model, self.job
        # The settling pass runs the first micro-batch the way every step runs its last (autocast, synchronised).
        changed = settle_buckets(model, functools.partial(job.forward, device=self.device),
                                 job.micro_batches(0, topo.rank)[0])
        self.buffer_names = checked_buffers(model, changed, self.unchecked_buffers)
        self.hook.check_nonfinite = cfg.nonfinite
        self.hook.check_reduced = cfg.reduced_grad
        self.hook.measure_norms = cfg.trigger_ratio > 0 or cfg.confirm
        # With clipping, clip_grad_norm_ measures the norm itself.
        self.hook.measure_reduced_norm = cfg.max_grad_norm is None
        self.hook.register(model)

    # -- the rank's own pass ---------------------------------------------------------------------------

    def forward_backward(self, step: int, *, audited: bool) -> StepFindings:
        """Every micro-batch's forward (under autocast) and backward through DDP, its loss divided by K, DDP
        synchronising on the last only; so the hook sees the accumulated local gradients before their
        all-reduce, and checks them as they are reduced. The loss is the mean."""
        job = self.job
        self.optimizer.zero_grad(set_to_none=True)
        replay.seed_micro_batch(job.config.seed, step, job.topology.rank, self.device)
        self.hook.begin_step(record_params=audited)
        batches = self.own_batches = job.micro_batches(step, job.topology.rank)
        k = len(batches)
        total: torch.Tensor | None = None
        for i, batch in enumerate(batches):
            with contextlib.nullcontext() if i == k - 1 else self.model.no_sync():
                loss = job.forward(self.model, batch, self.device)
                if k > 1:
                    loss = loss / k
                job.scaled(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return StepFindings(loss=total, summary=self.hook.summary(total, self.device))

    def own_claim(self, found: StepFindings, *, digests: bool) -> torch.Tensor:
        return confirm.claim_from_hook(found.loss, self.hook, self.device, digests=digests,
                                       batch=batch_digest(self.own_batches, self.device))

    def local_norm(self, found: StepFindings) -> torch.Tensor:
        return torch.linalg.vector_norm(self.hook.bucket_norms(self.device))

    def reduced_norm(self) -> torch.Tensor | None:
        return self.hook.reduced_norm(self.device) if self.hook.measure_reduced_norm else None

    # -- recomputations --------------------------------------------------------------------------------

    def _recompute(self, step: int, owner: int, batches: list[Any]) -> Recomputation:
        """``owner``'s whole step (its K micro-batches, ``batches``) on the bare module, bit for bit as its own
        pass ran it."""
        job = self.job
        seed = functools.partial(replay.seed_micro_batch, job.config.seed, step, owner, self.device)
        return recompute_step(self.model.module, job.loss_fn, batches, self.names, self.params, seed,
                              scale=job.scaled, forward_context=functools.partial(job.forward_context, self.device))

    def audit_records(self, step: int, found: StepFindings) -> tuple[torch.Tensor, torch.Tensor]:
        claimed = owner_record(found.loss, self.hook, self.device)
        recomputation = self._recompute(step, self.audits, self.job.micro_batches(step, self.audits))
        # Digests, not copies, outlive the recomputation.
        return claimed, audit_record(recomputation, self.hook.layout, self.device)

    def recompute_claim(self, step: int, owner: int, *, digests: bool) -> torch.Tensor:
        batches = self.job.micro_batches(step, owner)
        return confirm.claim_from_recomputation(self._recompute(step, owner, batches), self.hook.layout,
                                                self.device, nonfinite=self.job.config.nonfinite,
                                                norms=self.hook.measure_norms, digests=digests,
                                                batch=batch_digest(batches, self.device))

    def digest_names(self) -> list[str]:
        return layout_order(self.hook.layout)

    # -- detector 3, checkpoints, injection ------------------------------------------------------------

    def checked_tensors(self) -> list[torch.Tensor]:
        """What the weight fingerprint covers beyond the trainable parameters and the optimizer state:
        the frozen parameters, then the checked buffers (looked up by name: a load may replace them)."""
        params = dict(self.model.module.named_parameters())
        buffers = dict(self.model.module.named_buffers())
        return [params[n] for n in self.frozen_names] + [buffers[n] for n in self.buffer_names]

    def state_lanes(self) -> torch.Tensor:
        return state_fingerprint(self.params, self.optimizer, self.checked_tensors()).to(self.device)

    def agreed_digest(self, verdict: GroupVerdict) -> str:
        return verdict.agreed()[0]

    def state_fingerprint_hex(self) -> str:
        return state_fingerprint_hex(self.params, self.optimizer, self.checked_tensors())

    def local_fingerprint_hex(self) -> str:
        return self.state_fingerprint_hex()

    def checkpoint_writer(self, prefix: str, *, corrupt: Any, written_by: str) -> Checkpoints:
        return CheckpointWriter(prefix, corrupt=corrupt, group=self.group, written_by=written_by)

    def injection_site(self, optimizer: torch.optim.Optimizer,
                       register_step_hook: Callable[[Callable[[int], None]], None]) -> InjectionSite:
        return InjectionSite(model=self.model, optimizer=optimizer, hook=self.hook,
                             register_step_hook=register_step_hook)


def settle_buckets(model: torch.nn.parallel.DistributedDataParallel,
                   loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any) -> set[str]:
    """One forward and backward that changes nothing, so every real step reduces with DDP's final buckets.

    DDP all-reduces its first backward with buckets in parameter order, then
    rebuilds them in the order the gradients became ready. Where an element
    sits in the flat buffer decides the order in which the all-reduce sums it
    across ranks, so with three or more ranks a job resumed from a checkpoint
    (a fresh DDP, on its first layout) and one that never stopped (on the
    rebuilt layout) round differently at the resumed step, and the resume is
    not bit-exact. Settling the layout here, before any real step, makes the
    first step of every start use the layout of every later one. It runs before
    the communication hook and fault injection are installed, leaves no
    gradient, and restores the random state and the module's buffers (batch
    norm statistics), so the weights, optimizer and data are untouched.

    Returns the names of the buffers the training forward changed (they differ
    between replicas by design, so the weight fingerprint leaves them out).
    """
    module = model.module
    before = {n: b.detach().clone() for n, b in module.named_buffers()}
    changed: set[str] = set()
    with preserved(module):
        loss_fn(model, batch).backward()
        changed = {n for n, b in module.named_buffers() if n in before and not torch.equal(b, before[n])}
    for param in model.parameters():
        param.grad = None
    return changed
