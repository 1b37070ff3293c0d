"""FSDP2 behind the guard's seam: every detector on a model sharded by ``fully_shard`` on a DeviceMesh.

``SDCGuard(model, optimizer, ..., mesh=mesh)`` runs its step through
:class:`ShardedDataParallel` when ``model`` has had
``fully_shard(..., mesh=mesh)`` applied. ``mesh`` is 2-D with dims
``("replicate", "shard")`` (HSDP: G replica groups of S shards; rank
``(g, s)`` is ``g * S + s``, as ``init_device_mesh`` lays it out) or 1-D
(pure FSDP: one group of S shards, no replica), or 3-D ``("replicate",
"shard", "tp")`` (torchtitan's ``dp_replicate``/``dp_shard``/``tp`` too):
tensor parallelism inside each node, the model TP'd on ``mesh["tp"]`` before
``fully_shard`` on ``mesh["replicate", "shard"]``. Under TP a "shard
position" below is a (shard, tp) position: rank ``(g, s, t)`` is
``g*S*T + s*T + t``, and the ranks of one position across the replicas hold
the same bits (sdcguard.agent.tensor_parallel reads the mesh and refuses what
it cannot check). A TP group trains on one micro-batch with one seed, and
recomputes another TP group's as a group.

Where each detector gets its data (nothing is copied whole):

- **Local gradients** (non-finite check, ring audit): every FSDP module's
  reduce-scatter input is shown to sdcguard.agent.reduce_scatter_observer first: that
  group's unsharded local gradients, before any communication.
- **Reduced shards** (non-finite check, cross-replica comparison): after the
  backward, each parameter's ``.grad`` is a DTensor whose local tensor is the
  shard after the reduce-scatter and the replicas' all-reduce. The same shard
  must have the same bits in every replica: the replicas of each shard
  position are one vote group, compared within the step's one all-reduce.
- **Weights and optimizer state**: each rank fingerprints its local shards
  (parameters, trainable and frozen, and every optimizer-state tensor); one
  all-gather, then a strict-majority vote among the G ranks that hold each
  shard (3 or more replicas localise, 2 detect).
- **Ring audit**: rank ``(g, s)`` recomputes the micro-batch of ``(g+1, s)``
  (pure FSDP: of the same shard position on the next node). FSDP must
  all-gather the parameters for a forward, so every rank recomputes at once
  (they all audit on the same steps). The recomputation runs through the FSDP
  model with its reduce-scatters answered locally (zeros out, no
  communication) and the replica all-reduce off; the real sharded gradients
  are set aside (references, not copies) and put back afterwards. Its extra
  memory is what one backward needs anyway (one FSDP group's unsharded
  gradients at a time) plus one sharded gradient, dropped at the end.
- **Confirmation before blame**: as for DDP (sdcguard.agent.confirm's ring and
  verdict), with a claim per FSDP group (which groups were non-finite, each
  group's local-gradient norm and, on audit steps, fingerprint). Every
  recomputation is a forward through the FSDP model, a collective of the
  shard group, so the confirmations run in lock step: one pass per
  confirmation slot on every rank, recomputing its assignment or, without one,
  its own micro-batch (the result unused); the replay is one more pass.
- **Replay capsules**: on a localised recomputation alarm every rank
  gathers the unsharded state (one all-gather per parameter) for the
  publishing rank, which recomputes the suspect's step on the plain model
  and writes the capsule (sdcguard.agent.sharded_capsule).

Not yet under a mesh: a GradScaler.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from sdcguard.agent import confirm, replay, weights
from sdcguard.agent import fingerprint as fp
from sdcguard.agent.batches import batch_digest
from sdcguard.agent.findings import StepFindings
from sdcguard.agent.nonfinite import MASK_BUCKETS, any_nonfinite, nonfinite_flag
from sdcguard.agent.parallelism import Checkpoints, InjectionSite, Job, Parallelism, gather_rows
from sdcguard.agent.recompute import preserved
from sdcguard.agent.reduce_scatter_observer import GroupFindings, ObservedReduceScatter, ReduceScatterObserver
from sdcguard.agent.ring_audit import loss_bits
from sdcguard.agent.sharded_checkpoint import ShardedCheckpointWriter
from sdcguard.agent.tensor_parallel import check_tp_batches, read_mesh
from sdcguard.agent.topology import node_of
from sdcguard.agent.weights import GroupVerdict, packed_fingerprints, vote_in_groups

log = logging.getLogger(__name__)

MASK_GROUPS = MASK_BUCKETS
"""FSDP groups beyond this still count in the flags; they are left out of the per-group evidence."""


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every module ``fully_shard`` was applied to, with its name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), detached."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


@dataclasses.dataclass(frozen=True)
class ShardsPass:
    """What one pass over this rank's reduced gradient shards found; None where it was not asked for."""

    nonfinite: torch.Tensor | None = None
    """0-dim bool on the shards' device: does a shard hold a NaN or an infinity?"""
    fingerprints: torch.Tensor | None = None
    """int64 [rows, 3]: ``sdcguard.agent.weights.packed_fingerprints`` of the shards."""


def reduced_shards(shards: Sequence[torch.Tensor], *, flag: bool, fingerprint: bool) -> ShardsPass:
    """``sdcguard.agent.nonfinite.any_nonfinite(shards)`` and ``sdcguard.agent.weights.packed_fingerprints(shards)``, as asked,
    with their bits, and no kernel per shard where the device has launches to save.

    Under ``SDCGUARD_FINGERPRINT_KERNEL=triton`` both come from one read of every shard: the multi-tensor
    fingerprint kernel raises the flag from the same loads (one launch per element width, its metadata
    cached per layout). Elsewhere they are two passes: the flag's is multi-tensor on an accelerator
    (``any_nonfinite``); the fingerprint is the torch or C implementation's. Nothing is read back to the
    host. Raises as ``packed_fingerprints``."""
    if not shards or not (flag or fingerprint):
        return ShardsPass()
    device = shards[0].device
    fused = fp.triton_kernels_for(device)
    if fused is not None and fingerprint and all(t.device == device for t in shards):
        found = torch.zeros(1, dtype=torch.int32, device=device) if flag else None
        rows = fused.layout_for(fp.packed_rows(shards, weights.PACK_BELOW))(nonfinite=found)
        return ShardsPass(found[0] != 0 if found is not None else None, rows)
    return ShardsPass(any_nonfinite(shards) if flag else None,
                      weights.packed_fingerprints(list(shards)) if fingerprint else None)


class ShardedDataParallel(Parallelism):
    """The guard's work on an FSDP2 model on a 1-D, ``("replicate", "shard")`` or ``("replicate", "shard", "tp")``
    DeviceMesh.

    Raises ``ValueError`` for a model without ``fully_shard``, a mesh
    ``sdcguard.agent.tensor_parallel.read_mesh`` refuses (naming TP where it is
    the reason), a ``group`` (the mesh is the group), or a GradScaler; and at
    the first step or an audit, on every rank, when the ranks of a TP group
    are given different micro-batches (naming ``batch_for``). Without
    replicas, the weight and reduced-gradient comparisons are switched off in
    ``job.config`` (a warning says so).
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, job: Job, *, mesh: Any,
                 group: dist.ProcessGroup | None) -> None:
        cfg, topo = job.config, job.topology
        # The mesh first: a TP model handed the wrong mesh is told so, whether or not it was sharded.
        self.layout = read_mesh(mesh, model, world=dist.get_world_size(), ranks_per_node=topo.ranks_per_node)
        if not isinstance(model, FSDPModule):
            raise ValueError("model: with a mesh, must have had torch.distributed.fsdp.fully_shard applied")
        if group is not None:
            raise ValueError("group: not used with a mesh (the mesh is the job's process group)")
        if job.scaler is not None:
            raise ValueError("scaler: a GradScaler is not supported with a mesh yet")
        self.mesh, self.replicas = self.layout.mesh, self.layout.replicas
        self.tp = self.layout.tp
        """Ranks of a TP group (1: no tensor parallelism)."""
        self.shards = self.layout.positions
        """The (shard, tp) positions of a replica group (FSDP shards x TP): the ranks that hold different bits."""
        self.replicated = self.replicas >= 2
        if not self.replicated:
            log.warning("no replicas (%s): weight and reduced-gradient comparison need replicas "
                        "and are off; the non-finite check and the ring audit run", self.layout.describe())
            cfg = dataclasses.replace(cfg, reduced_grad=False, fingerprint_every=0)
            job = dataclasses.replace(job, config=cfg)
        self.job = job
        self.model = model
        self.optimizer = optimizer
        self.group = None
        world = topo.world_size
        self.coordinate = divmod(topo.rank, self.shards)
        """(replica group, (shard, tp) position) of this rank."""
        self.tp_ranks = self.layout.tp_group(topo.rank)
        """The ranks of this rank's TP group, which train on one micro-batch (itself alone without TP)."""
        self.tp_group = self.mesh.get_group("tp") if self.tp > 1 else None
        """The process group of this rank's TP group (None without TP)."""
        self._batches_checked = False
        named = [(n, p) for n, p in cast("torch.nn.Module", model).named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frozen_names = [n for n, p in cast("torch.nn.Module", model).named_parameters() if not p.requires_grad]
        self.device = local(self.params[0]).device if self.params else torch.device("cpu")
        if self.tp > 2 and self.device.type == "cuda" and not os.environ.get("NCCL_ALGO"):
            # Two ranks' all-reduce is one commutative addition per element whatever NCCL picks; from three
            # on the order depends on its algorithm, and the audit compares after the TP collectives.
            log.warning("tensor parallel over %d ranks with NCCL_ALGO unset: NCCL may sum a TP all-reduce in "
                        "another order for the auditing group than for the audited one, and a clean audit then "
                        "fails; set NCCL_ALGO=Ring and NCCL_PROTO=Simple for the job (docs/gpu.md)", self.tp)
        # HSDP: the same (shard, tp) position in the next replica group; pure FSDP: the same local rank on the
        # next node (under TP the same tp position, as TP groups sit inside nodes: its TP group audits as one).
        self.audit_stride = self.shards if self.replicated else topo.ranks_per_node
        self.audit_possible = self.audit_stride % world != 0
        # Confirmers are the ranks the audit pairs with: the same shard position in the replica groups before
        # and after (pure FSDP: the same local rank on the nodes before and after).
        self.ring = confirm.Ring(world, self.audit_stride if self.audit_possible else world)
        if cfg.audit_every > 0 and self.audit_possible and any(
                node_of(r, topo.ranks_per_node) == node_of((r + self.audit_stride) % world, topo.ranks_per_node)
                for r in range(world)):
            log.warning("ring audit: some ranks recompute a micro-batch of their own node (%d ranks per node, "
                        "%d shards per replica); a fault of the whole node can agree with itself",
                        topo.ranks_per_node, self.shards)
        self.vote_groups = self.shard_holders()
        self.vote_slot = self.coordinate[1]
        self.collective_recompute = True
        self.audit_needs = "another replica group or another node"
        # FSDP neither shards nor broadcasts buffers: replicas update theirs from their own data
        # (batch-norm statistics), so no buffer is compared across replicas.
        self.buffer_names = []
        self.observer = ReduceScatterObserver()
        self.own_findings = GroupFindings(record=False)
        """What the reduce-scatter inputs of this step's own pass showed."""
        self.own_batches: list[Any] = []
        """The micro-batches of this step's own pass (references: digested only when a claim is made)."""
        self.agreed_shards: list[str] = []
        """The per-shard fingerprints of the last agreement (what a checkpoint manifest records)."""

    def install(self) -> None:
        """Route every FSDP module's reduce-scatter through the observer."""
        cfg = self.job.config
        self.observer.check_nonfinite = cfg.nonfinite
        self.observer.measure_norms = cfg.trigger_ratio > 0 or cfg.confirm
        for name, module in fsdp_modules(self.model):
            # A shard group of one rank (a (G, 1, T) mesh) never calls the reduce-scatter: observed at its buffers.
            module.set_custom_reduce_scatter(ObservedReduceScatter(name or "<root>", self.observer,
                                                                   local_only=self.layout.shards == 1))

    # -- the rank's own pass ---------------------------------------------------------------------------

    def _fsdp_pass(self, step: int, owner: int) -> tuple[torch.Tensor, list[Any]]:
        """``owner``'s whole step through the FSDP model: K micro-batches, synchronising on the last only; its
        loss and the micro-batches."""
        job = self.job
        # A TP group draws one set of random numbers (its first rank's seed): dropout of the activations it
        # holds replicated must drop the same elements on every rank of the group.
        replay.seed_micro_batch(job.config.seed, step, self.seed_rank(owner), self.device)
        batches = job.micro_batches(step, owner)
        k = len(batches)
        total: torch.Tensor | None = None
        try:
            for i, batch in enumerate(batches):
                if k > 1:
                    self.model.set_requires_gradient_sync(i == k - 1)
                loss = job.forward(self.model, batch, self.device)
                if k > 1:
                    loss = loss / k
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        finally:
            if k > 1:
                self.model.set_requires_gradient_sync(True)
        assert total is not None
        # Under loss parallel the loss is a DTensor, replicated over the TP group: its local value is the loss.
        return local(total), batches

    @property
    def split(self) -> tuple[int, int, int]:
        """(replicas, FSDP shards, TP ranks) of the mesh (what a checkpoint records of it)."""
        return self.layout.replicas, self.layout.shards, self.layout.tp

    def seed_rank(self, owner: int) -> int:
        """The rank whose seed ``owner``'s micro-batch is drawn with: the first of its TP group (itself without TP)."""
        return owner - owner % self.tp

    def forward_backward(self, step: int, *, audited: bool) -> StepFindings:
        """The rank's own pass; then its reduced shards are observed, checked and fingerprinted."""
        cfg = self.job.config
        if self.tp > 1 and (audited or not self._batches_checked):
            self._check_tp_batches(step)
        self.optimizer.zero_grad(set_to_none=True)
        seen = self.own_findings = self.observer.begin(record=audited)
        loss, self.own_batches = self._fsdp_pass(step, self.job.topology.rank)
        shards = [local(p.grad) for p in self.params if p.grad is not None]
        if self.observer.after_reduce:  # fault injection only
            for i, shard in enumerate(shards):
                if shard.numel():
                    for observer in self.observer.after_reduce:
                        observer(i, shard)
        zero = torch.zeros((), dtype=torch.bool, device=self.device)
        # One pass over all the shards, no kernel per parameter.
        reduced = reduced_shards(shards, flag=cfg.nonfinite, fingerprint=cfg.reduced_grad)
        reduced_any = reduced.nonfinite if reduced.nonfinite is not None else zero
        local_any = torch.stack(seen.flags).any() if seen.flags else zero
        lanes = (fp.combine(reduced.fingerprints) if reduced.fingerprints is not None
                 else torch.zeros(fp.LANES, dtype=torch.int64, device=self.device))
        loss_nonfinite = nonfinite_flag(loss) if cfg.nonfinite else zero
        # sdcguard.agent.nonfinite's summary layout: a shard's reduction is one "bucket" (bit 0 of the reduced mask).
        flags = torch.stack([local_any.to(self.device), reduced_any.to(self.device)]).to(torch.int64)
        summary = torch.cat([flags, _mask(seen, self.device).reshape(1), flags[1:],
                             loss_nonfinite.to(self.device, torch.int64).reshape(1), lanes.to(self.device)])
        return StepFindings(loss=loss, summary=summary)

    def _check_tp_batches(self, step: int) -> None:
        """The ranks of every TP group are given one micro-batch (first step and audit steps): ValueError naming
        ``batch_for`` on every rank when a group's are not (one all-reduce of a flag, so no rank goes on alone)."""
        self._batches_checked = True
        problem = check_tp_batches(self.job.micro_batches, step, self.tp_ranks, self.device)
        flag = torch.tensor([problem is not None], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if problem is not None:
            raise ValueError(problem)
        if int(flag.item()):
            raise ValueError(f"batch_for: at step {step} the ranks of another TP group were given different "
                             "micro-batches (under tensor parallelism a TP group trains on one micro-batch)")

    def own_claim(self, found: StepFindings, *, digests: bool) -> torch.Tensor:
        return self._claim(found.loss, self.own_findings, self.own_batches, digests=digests)

    def local_norm(self, found: StepFindings) -> torch.Tensor:
        seen = self.own_findings
        if not seen.norms:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.linalg.vector_norm(torch.stack(seen.norms))

    def reduced_norm(self) -> torch.Tensor | None:
        return None

    # -- recomputations --------------------------------------------------------------------------------

    def _claim(self, loss: torch.Tensor, seen: GroupFindings, batches: list[Any], *, digests: bool) -> torch.Tensor:
        """A rank's claim about one pass (``sdcguard.agent.confirm``'s layout): the digest of its micro-batches, loss
        bits, the mask of non-finite FSDP groups, each group's local-gradient norm bits, and with ``digests``
        each group's fingerprint."""
        head = confirm.batch_lanes(batch_digest(batches, self.device), self.device)
        parts = [head, loss_bits(loss).reshape(1).to(self.device), _mask(seen, self.device).reshape(1)]
        if seen.norms:
            norms = torch.stack(seen.norms)
            # One NaN, whatever the payload the arithmetic left: a data fault's claim must match its recomputation.
            norms = torch.where(torch.isnan(norms), torch.full_like(norms, math.nan), norms)
            parts.append(confirm.float_bits(norms).to(self.device))
        if digests:
            parts += [r.to(self.device).reshape(-1) for r in seen.rows]
        return torch.cat(parts)

    def _record(self, loss: torch.Tensor, seen: GroupFindings) -> torch.Tensor:
        """An audit record: the loss bits, then each FSDP group's fingerprint."""
        rows = [r.to(self.device).reshape(-1) for r in seen.rows]
        return torch.cat([loss_bits(loss).reshape(1).to(self.device), *rows])

    def audit_records(self, step: int, found: StepFindings) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank recomputes the rank it audits at once (a collective of the shard group)."""
        claimed = self._record(found.loss, self.own_findings)
        loss, seen, _ = self._recompute_pass(step, self.audits, record=True)
        recomputed = self._record(loss, seen)
        if recomputed.shape != claimed.shape:
            raise RuntimeError("ring audit: the recomputation reduce-scattered a different number of FSDP groups "
                               f"({recomputed.numel()} vs {claimed.numel()} record entries)")
        return claimed, recomputed

    def recompute_claim(self, step: int, owner: int, *, digests: bool) -> torch.Tensor:
        """A collective of the shard group: every rank calls it at once (see :meth:`_recompute_pass`); under TP
        the TP group recomputes one TP group's micro-batch together (:meth:`_group_owner`)."""
        owner = self._group_owner(owner)
        return self._claim(*self._recompute_pass(step, owner, record=digests), digests=digests)

    def _group_owner(self, owner: int) -> int:
        """The rank whose micro-batch this rank recomputes when the guard asks for ``owner``'s.

        Under TP a recomputation is a collective of the TP group (its all-reduces), so the group's ranks must
        recompute the ranks of one other TP group, position by position: a confirmation may assign ``owner``
        to one rank of a TP group and none to its peers, which then recompute their own micro-batch (the
        guard's filler, its result unused). The group agrees on one offset (an all-gather of one number
        within the TP group, on the confirmation path only); a filler takes it. Raises RuntimeError when the
        group's ranks were assigned micro-batches of different TP groups in one pass (a ring whose stride
        is not a multiple of the TP size)."""
        if self.tp == 1:
            return owner
        rank, world = self.job.topology.rank, self.job.topology.world_size
        mine = torch.tensor([(owner - rank) % world], dtype=torch.int64, device=self.device)
        offsets = [torch.empty_like(mine) for _ in range(self.tp)]
        dist.all_gather(offsets, mine, group=self.tp_group)
        wanted = {int(o.item()) for o in offsets} - {0}
        if len(wanted) > 1:
            raise RuntimeError(f"TP group {self.tp_ranks}: asked to recompute micro-batches at offsets "
                               f"{sorted(wanted)} in one pass; a TP group recomputes one other TP group at a time")
        return (rank + wanted.pop()) % world if wanted else owner

    def _recompute_pass(self, step: int, owner: int, *,
                        record: bool) -> tuple[torch.Tensor, GroupFindings, list[Any]]:
        """``owner``'s step recomputed here: its loss, what its reduce-scatter inputs showed and the micro-batches
        it rebuilt; changes nothing.

        A collective within the shard group (FSDP all-gathers the parameters), so every rank calls it at once.
        The reduce-scatters are answered locally and the replicas' all-reduce is off, so nothing is sent; the
        sharded gradients of this step are set aside and put back, and FSDP's partial-reduce state is restored.
        """
        params = list(self.model.parameters())
        kept = [p.grad for p in params]
        partial = _partial_outputs(self.model)
        findings_before = self.observer.findings
        for p in params:
            p.grad = None
        seen = self.observer.begin(record=record)
        self.observer.communicate = False
        # Without a way to drop the partial reduction FSDP would keep, the replicas' all-reduce stays on
        # (it sums zeros: correct, one wasted all-reduce of a shard).
        quiet = self.replicated and len(partial) == len(_param_groups(self.model))
        if quiet:
            self.model.set_requires_all_reduce(False)
        try:
            with preserved(self.model):
                loss, batches = self._fsdp_pass(step, owner)
        finally:
            self.observer.communicate = True
            if quiet:
                self.model.set_requires_all_reduce(True)
            _restore_partial_outputs(partial)
            for p, g in zip(params, kept, strict=True):
                p.grad = g
            self.observer.findings = findings_before
        return loss, seen, batches

    def digest_names(self) -> list[str]:
        return self.own_findings.names

    def param_label(self, name: str) -> str:
        """Under a mesh a digest is an FSDP group's."""
        return f"FSDP group {name}"

    # -- detector 3 ------------------------------------------------------------------------------------

    def shard_holders(self) -> list[list[int]]:
        """``[S][G]``: the global ranks holding shard position s, by replica group."""
        return [[g * self.shards + s for g in range(self.replicas)] for s in range(self.shards)]

    def mesh_ranks(self) -> list[list[int]]:
        """``[G][S]``: the global rank holding shard position s in replica group g."""
        return [[g * self.shards + s for s in range(self.shards)] for g in range(self.replicas)]

    def local_state(self) -> list[torch.Tensor]:
        """This rank's shards of what must agree across replicas, in a fixed order: trainable parameters,
        each one's optimizer state, then the frozen parameters."""
        tensors = [local(p) for p in self.params]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                tensors += [local(v) for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
        named = dict(self.model.named_parameters())
        return tensors + [local(named[n]) for n in self.frozen_names]

    def state_lanes(self) -> torch.Tensor:
        """The fingerprint lanes of :meth:`local_state`."""
        tensors = self.local_state()
        if not tensors:
            return torch.zeros(fp.LANES, dtype=torch.int64, device=self.device)
        return fp.combine(packed_fingerprints(tensors)).to(self.device)

    def local_fingerprint_hex(self) -> str:
        """This rank's shard fingerprint as hex (what a checkpoint's manifest holds for its shard position)."""
        return fp.to_hex(self.state_lanes())

    def agreed_digest(self, verdict: GroupVerdict) -> str:
        """One digest of every shard, in shard order; the per-shard ones are kept in ``agreed_shards``."""
        self.agreed_shards = verdict.agreed()
        return _combined(self.agreed_shards)

    def state_fingerprint_hex(self) -> str:
        """The one digest of every shard that all replicas agree on (a collective); "replicas-disagree" else."""
        rows = gather_rows(self.state_lanes(), self.job.topology.world_size, None)
        verdict = vote_in_groups(rows, self.vote_groups)
        if not verdict.unanimous:
            return "replicas-disagree"
        return _combined(verdict.agreed())

    def checkpoint_writer(self, prefix: str, *, corrupt: Any, written_by: str) -> Checkpoints:
        return ShardedCheckpointWriter(prefix, positions=self, corrupt=corrupt, written_by=written_by)

    def injection_site(self, optimizer: torch.optim.Optimizer,
                       register_step_hook: Callable[[Callable[[int], None]], None]) -> InjectionSite:
        # The injector hooks ``model.module``, as a DDP model offers it.
        return InjectionSite(model=types.SimpleNamespace(module=self.model), optimizer=optimizer,
                             hook=self.observer, register_step_hook=register_step_hook)


def _mask(seen: GroupFindings, device: torch.device) -> torch.Tensor:
    """The bit mask of the FSDP groups (the first MASK_GROUPS) whose reduce-scatter input was non-finite."""
    if not seen.flags:
        return torch.zeros((), dtype=torch.int64, device=device)
    flags = torch.stack(seen.flags[:MASK_GROUPS]).to(device, torch.int64)
    return (flags << torch.arange(flags.numel(), device=device)).sum()


def _combined(shard_hexes: Sequence[str]) -> str:
    rows = torch.stack([_lanes_of(h) for h in shard_hexes])
    return fp.to_hex(fp.combine(rows))


def _lanes_of(hex_fingerprint: str) -> torch.Tensor:
    raw = bytes.fromhex(hex_fingerprint)
    return torch.tensor([int.from_bytes(raw[i:i + 8], "big", signed=True) for i in range(0, len(raw), 8)],
                        dtype=torch.int64, device="cpu")


def _param_groups(model: torch.nn.Module) -> list[Any]:
    groups = []
    for _, module in fsdp_modules(model):
        state = module._get_fsdp_state()
        groups += list(getattr(state, "_fsdp_param_groups", ()))
    return groups


def _partial_outputs(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """Each FSDP param group's pending partial reduction (HSDP without all-reduce keeps one for the next
    backward); a recomputation's zeros must not be added to the next step's gradients (-0.0 + 0.0 is +0.0)."""
    return [(g, g._partial_reduce_output) for g in _param_groups(model) if hasattr(g, "_partial_reduce_output")]


def _restore_partial_outputs(saved: list[tuple[Any, Any]]) -> None:
    for group, value in saved:
        group._partial_reduce_output = value
