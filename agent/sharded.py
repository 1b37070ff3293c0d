"""The guard under FSDP2: every detector on a model sharded by ``fully_shard`` on a DeviceMesh.

``SDCGuard(model, optimizer, ..., mesh=mesh)`` builds a :class:`ShardedGuard`
when ``model`` has had ``fully_shard(..., mesh=mesh)`` applied. ``mesh`` is
2-D with dims ``("replicate", "shard")`` (HSDP: G replica groups of S shards;
rank ``(g, s)`` is ``g * S + s``, as ``init_device_mesh`` lays it out) or 1-D
(pure FSDP: one group of S shards, no replica).

Where each detector gets its data (nothing is copied whole):

- **Local gradients** (non-finite check, ring audit): every FSDP module's
  reduce-scatter goes through :class:`_ObservedReduceScatter`, set with
  ``set_custom_reduce_scatter``. Its input is that group's unsharded local
  gradients, laid out by FSDP (``chunk_cat``: S rows of padded shards), before
  any communication: a NaN there names the rank that made it, and on audit
  steps its fingerprint (one per FSDP group) is this rank's claim.
- **Reduced shards** (non-finite check, cross-replica comparison): after the
  backward, each parameter's ``.grad`` is a DTensor whose local tensor is the
  shard after the reduce-scatter and the replicas' all-reduce. The same shard
  must have the same bits in every replica: one fingerprint per rank, compared
  per shard position within the step's one all-reduce.
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

- **Confirmation before blame** (and the magnitude trigger, which only asks
  for one): as for DDP, a rank whose pass made a NaN/Inf, whose loss or
  local-gradient norm jumped, or that failed an audit has its micro-batch
  recomputed by the ranks ``stride`` before and after it (``agent.confirm``'s
  ring and verdict); a localised suspect replays once (transient or
  persistent). A rank's claim is its loss bits, which FSDP groups were
  non-finite, each group's local-gradient norm and, on audit steps, each
  group's fingerprint. Every recomputation is a forward through the FSDP
  model, a collective of the shard group, so the confirmations run in lock
  step: one pass per confirmation slot (two with 3 or more replica groups or
  nodes, one with 2) on every rank, recomputing its assignment or, without
  one, its own micro-batch (the result unused); the replay is one more pass.

Not yet under a mesh: a GradScaler.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.distributed.tensor import DTensor

from agent import confirm, native, replay
from agent import fingerprint as fp
from agent.alarm import fingerprint_evidence, gather_identities, nonfinite_evidence
from agent.config import GuardConfig
from agent.guard import BatchFor, LossFn, SDCGuard, StepResult, _Confirmation
from agent.inject import Injection, Injector, corrupt_checkpoint_bytes
from agent.inject import from_env as injection_from_env
from agent.nonfinite import nonfinite_flag
from agent.publisher import Publisher
from agent.ring_audit import AuditVerdict, loss_bits, preserved
from agent.ring_audit import judge as judge_audit
from agent.topology import Topology, node_of
from agent.trigger import MagnitudeTrigger
from agent.weights import Vote, packed_fingerprints, vote
from contract import Alarm, Detector, NonFiniteEvidence
from contract.alarm import FaultPersistence

if TYPE_CHECKING:
    from agent.sharded_checkpoint import ShardedCheckpointWriter

log = logging.getLogger(__name__)

MESH_DIMS = ("replicate", "shard")
"""The dim names of an HSDP mesh."""

# The step's flags, and the gathered row of one rank (only on disagreement): the flags, the reduced lanes,
# the mask of non-finite FSDP groups, then the rank's claim (agent.confirm's layout).
ROW_LOCAL, ROW_REDUCED, ROW_LOSS, ROW_AUDIT_BAD, ROW_TRIGGER = range(5)
FLAGS = 5
ROW_LANES = slice(FLAGS, FLAGS + fp.LANES)
ROW_LOCAL_MASK = FLAGS + fp.LANES
ROW_CLAIM = ROW_LOCAL_MASK + 1
MASK_GROUPS = 63
"""FSDP groups beyond this still count in the flags; they are left out of the per-group evidence."""

_LOWEST = torch.iinfo(torch.int64).min


class _Seen:
    """What the reduce-scatter inputs of one pass (the rank's own, or a recomputation) showed."""

    def __init__(self, *, record: bool) -> None:
        self.record = record
        self.flags: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        """Each group's local-gradient norm (fp64), when the hook measures them (trigger, confirmation)."""
        self.names: list[str] = []


class ShardedGradientHook:
    """The observers of every FSDP group's reduce-scatter input, and what they saw this step.

    ``before_reduce`` observers get (group index in backward order, the
    reduce-scatter input) before it is checked (fault injection);
    ``after_reduce`` observers get (parameter index, this rank's reduced local
    shard) after the backward, before it is checked.
    """

    def __init__(self) -> None:
        self.before_reduce: list[Callable[[int, torch.Tensor], None]] = []
        self.after_reduce: list[Callable[[int, torch.Tensor], None]] = []
        self.check_nonfinite = True
        self.measure_norms = False
        self.communicate = True
        """False during a recomputation: the reduce-scatter is answered locally with zeros."""
        self.seen = _Seen(record=False)

    def begin(self, *, record: bool) -> _Seen:
        """Start a pass; returns the record of what it will see (per-group fingerprints if ``record``)."""
        self.seen = _Seen(record=record)
        return self.seen

    def on_input(self, name: str, flat: torch.Tensor) -> None:
        seen = self.seen
        index = len(seen.names)
        for observer in self.before_reduce:
            observer(index, flat)
        seen.names.append(name)
        if self.check_nonfinite:
            seen.flags.append(nonfinite_flag(flat))
        if self.measure_norms:
            # The same op on the same bits gives the same norm on the rank that recomputes it (one thread,
            # as the guard pins): a claim a confirmation compares bit for bit.
            seen.norms.append(torch.linalg.vector_norm(flat, dtype=torch.float64))
        if seen.record:
            seen.rows.append(fp.fingerprint(flat))


class _ObservedReduceScatter(DefaultReduceScatter):
    """FSDP's default reduce-scatter, with the unsharded local gradients shown to the hook first."""

    def __init__(self, name: str, hook: ShardedGradientHook) -> None:
        self.name = name
        self.hook = hook

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        self.hook.on_input(self.name, input_tensor)
        if not self.hook.communicate:
            output_tensor.zero_()
            return None
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


@dataclass
class _ShardPass:
    """What the rank's own forward and backward left for the verdict."""

    loss: torch.Tensor
    seen: _Seen
    local_any: torch.Tensor
    reduced_any: torch.Tensor
    loss_nonfinite: torch.Tensor
    reduced_lanes: torch.Tensor
    own_record: torch.Tensor | None = None
    audit_record: torch.Tensor | None = None
    audit_bad: torch.Tensor | None = None
    trigger: torch.Tensor | None = None


@dataclass(frozen=True)
class _MeshNonfinite:
    """Detector 1's reading of the gathered rows: who saw NaN/Inf where (the groups: evidence triples)."""

    local_ranks: list[int]
    loss_ranks: list[int]
    reduced_ranks: list[int]
    groups: list[tuple[int, int, str]]


@dataclass
class _InjectionView:
    """What ``Injector.install`` reaches for on a guard: ``model.module``, the optimizer, the hook."""

    model: Any
    optimizer: torch.optim.Optimizer
    hook: ShardedGradientHook
    register_step_hook: Callable[[Callable[[int], None]], None]


@dataclass(frozen=True)
class ShardVerdict:
    """The vote among the replicas of each shard position."""

    votes: list[Vote]
    """One per shard position, over global ranks."""
    rows: torch.Tensor
    """Every rank's lanes, ``[world, LANES]``."""
    holders: list[list[int]] = field(default_factory=list)

    @property
    def unanimous(self) -> bool:
        return all(v.unanimous for v in self.votes)

    @property
    def dissenters(self) -> list[int]:
        return sorted(r for v in self.votes for r in v.dissenters)

    @property
    def localized(self) -> bool:
        """Every shard that disagrees has a strict majority."""
        return all(v.majority is not None for v in self.votes if not v.unanimous)

    def groups(self) -> list[tuple[str, list[int]]]:
        """(fingerprint, ranks) of every shard position that disagreed, the largest group first."""
        return [g for v in self.votes if not v.unanimous for g in v.groups][:64]

    def majority(self) -> str | None:
        return next((v.majority for v in self.votes if not v.unanimous), None)


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, FSDPModule]]:
    """Every module ``fully_shard`` was applied to, with its name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), detached."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


class ShardedGuard(SDCGuard):
    """:class:`agent.guard.SDCGuard` for an FSDP2 model on a 1-D or ``("replicate", "shard")`` DeviceMesh.

    Built by ``SDCGuard(model, optimizer, ..., mesh=mesh)``. Raises
    ``ValueError`` for a model without ``fully_shard``, a mesh that is not 1-D
    or named ``("replicate", "shard")``, a mesh not laid out rank by rank over
    the whole world, a ``group`` (the mesh is the group), or a GradScaler.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn,
        batch_for: BatchFor,
        config: GuardConfig | None = None,
        publisher: Publisher | None = None,
        scaler: torch.amp.GradScaler | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        injection: Injection | str | None = "env",
        group: dist.ProcessGroup | None = None,
        checkpoints: ShardedCheckpointWriter | None = None,
        unchecked_buffers: tuple[str, ...] = (),
        mesh: DeviceMesh | None = None,
    ) -> None:
        if not isinstance(model, FSDPModule):
            raise ValueError("model: with a mesh, must have had torch.distributed.fsdp.fully_shard applied")
        if group is not None:
            raise ValueError("group: not used with a mesh (the mesh is the job's process group)")
        if scaler is not None and scaler.is_enabled():
            raise ValueError("scaler: a GradScaler is not supported with a mesh yet")
        self.mesh, self.replicas, self.shards = _check_mesh(mesh)
        cfg = config if config is not None else GuardConfig.from_env()
        self.replicated = self.replicas >= 2
        if not self.replicated:
            log.warning("no replicas (a %d-D mesh of %d): weight and reduced-gradient comparison need replicas "
                        "and are off; the non-finite check and the ring audit run", self.mesh.ndim, self.shards)
            cfg = dataclasses.replace(cfg, reduced_grad=False, fingerprint_every=0)
        self.config = cfg
        replay.pin_threads(cfg.threads)
        native.kernel()
        self.model = cast("Any", model)  # the base class's DDP-typed slot
        self.fsdp: Any = model
        """The FSDP2 model (``FSDPModule`` methods: gradient sync, all-reduce)."""
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        self.scaler = None
        self.scheduler = scheduler
        self.group = None
        world = dist.get_world_size()
        self.topology = Topology.from_env(ranks_per_node=cfg.ranks_per_node, rank=dist.get_rank(), world_size=world)
        topo = self.topology
        self.coordinate = divmod(topo.rank, self.shards)
        """(replica group, shard position) of this rank."""
        self.publisher = publisher if publisher is not None else Publisher(cfg)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
        self.device = local(self.params[0]).device if self.params else torch.device("cpu")
        # HSDP: the same shard position in the next replica group; pure FSDP: the same local rank on the next node.
        self.stride = self.shards if self.replicated else topo.ranks_per_node
        self.audits = (topo.rank + self.stride) % world
        self.audited_by = (topo.rank - self.stride) % world
        self.audit_enabled = cfg.audit_every > 0 and self.stride % world != 0
        # Confirmers are the ranks the audit pairs with: the same shard position in the replica groups before
        # and after (pure FSDP: the same local rank on the nodes before and after).
        self.ring = confirm.Ring(world, self.stride if self.stride % world else world)
        if cfg.audit_every > 0 and not self.audit_enabled:
            log.warning("ring audit off: it needs another replica group or another node (world %d, %d ranks per "
                        "node)", world, topo.ranks_per_node)
        elif self.audit_enabled and any(node_of(r, topo.ranks_per_node) == node_of((r + self.stride) % world,
                                                                                   topo.ranks_per_node)
                                        for r in range(world)):
            log.warning("ring audit: some ranks recompute a micro-batch of their own node (%d ranks per node, "
                        "%d shards per replica); a fault of the whole node can agree with itself",
                        topo.ranks_per_node, self.shards)
        if cfg.deterministic and self.audit_enabled:
            replay.use_deterministic_algorithms(self.device)
        # FSDP neither shards nor broadcasts buffers: replicas update theirs from their own data
        # (batch-norm statistics), so no buffer is compared across replicas.
        self.buffer_names: list[str] = []
        self._step_hooks: list[Callable[[int], None]] = []
        self._stepped = False
        optimizer.register_step_post_hook(self._on_optimizer_step)
        self.shard_hook = ShardedGradientHook()
        self.shard_hook.check_nonfinite = cfg.nonfinite
        self.shard_hook.measure_norms = cfg.trigger_ratio > 0 or cfg.confirm
        self.fsdp_modules = fsdp_modules(model)
        for name, module in self.fsdp_modules:
            module.set_custom_reduce_scatter(_ObservedReduceScatter(name or "<root>", self.shard_hook))
        self.trigger = (MagnitudeTrigger(cfg.trigger_ratio, cfg.trigger_window, cfg.trigger_warmup, self.device)
                        if cfg.trigger_ratio > 0 else None)
        if isinstance(injection, str):
            injection = injection_from_env()
        self.injector = Injector(injection, topo.rank, topo.node)
        self.injector.install(_InjectionView(model=_Wrapped(model), optimizer=optimizer, hook=self.shard_hook,
                                             register_step_hook=self.register_step_hook))
        self.identities = gather_identities(topo, self.device, None)
        self.run_id = self._agree_run_id()
        self.last_clean: dict[str, int | None] = {d.value: None for d in Detector}
        self.overflow_streak = 0
        self.data_fault_streak = 0
        self.alarms: list[Alarm] = []
        self._checkpoints = cast("Any", checkpoints)
        self.resumed = None
        self.agreed_shards: list[str] = []
        """The per-shard fingerprints of the last agreement (what a checkpoint manifest records)."""
        self.republished = {}
        if topo.rank == 0:
            self.republished = self.publisher.republish_spooled()

    # -- the step -------------------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        """Run training step ``step`` with every due check; update only if all passed (as ``SDCGuard.step``)."""
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        for hook in self._step_hooks:
            hook(step)
        cfg = self.config
        result = StepResult(step=step, loss=math.nan)
        if cfg.fingerprint_every and step % cfg.fingerprint_every == 0:
            result.weights_checked = True
            alarm = self.agreed_fingerprint(step)[1]
            if alarm is not None:
                return self._handle(alarm, result)
        result.audited = self.audit_enabled and step % cfg.audit_every == 0
        own = self._shard_pass(step, result.audited)
        if result.audited:
            self._shard_audit(step, own)
        if self.trigger is not None:
            own.trigger = self.trigger.fires(own.loss, _local_norm(own.seen, self.device))
        agreed = self._shard_agree(own)
        result.loss = float(own.loss.detach())
        result.triggered = bool(own.trigger) if own.trigger is not None else False
        if agreed:
            return self._update(step, result)
        alarm = self._shard_resolve(step, own, result)
        if alarm is not None:
            return self._handle(alarm, result)
        if result.data_fault:
            self._apply_update(overflow=True)
            return result
        return self._update(step, result)

    def _fsdp_pass(self, step: int, owner: int) -> torch.Tensor:
        """``owner``'s whole step through the FSDP model: K micro-batches, synchronising on the last only."""
        replay.seed_micro_batch(self.config.seed, step, owner)
        batches = self._micro_batches(step, owner)
        k = len(batches)
        total: torch.Tensor | None = None
        try:
            for i, batch in enumerate(batches):
                if k > 1:
                    self.fsdp.set_requires_gradient_sync(i == k - 1)
                loss = self._forward(self.model, batch)
                if k > 1:
                    loss = loss / k
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        finally:
            if k > 1:
                self.fsdp.set_requires_gradient_sync(True)
        assert total is not None
        return total

    def _shard_pass(self, step: int, audited: bool) -> _ShardPass:
        """The rank's own pass; then its reduced shards are observed, checked and fingerprinted."""
        self.optimizer.zero_grad(set_to_none=True)
        seen = self.shard_hook.begin(record=audited)
        loss = self._fsdp_pass(step, self.topology.rank)
        shards = [local(p.grad) for p in self.params if p.grad is not None]
        for i, shard in enumerate(shards):
            if shard.numel():
                for observer in self.shard_hook.after_reduce:
                    observer(i, shard)
        zero = torch.zeros((), dtype=torch.bool, device=self.device)
        reduced_any = torch.stack([nonfinite_flag(t) for t in shards]).any() if shards and self.config.nonfinite \
            else zero
        local_any = torch.stack(seen.flags).any() if seen.flags else zero
        lanes = fp.combine(packed_fingerprints(shards)) if shards and self.config.reduced_grad \
            else torch.zeros(fp.LANES, dtype=torch.int64, device=self.device)
        return _ShardPass(loss=loss, seen=seen, local_any=local_any, reduced_any=reduced_any,
                          loss_nonfinite=nonfinite_flag(loss) if self.config.nonfinite else zero,
                          reduced_lanes=lanes.to(self.device))

    def _record(self, loss: torch.Tensor, seen: _Seen) -> torch.Tensor:
        rows = [r.to(self.device).reshape(-1) for r in seen.rows]
        return torch.cat([loss_bits(loss).reshape(1).to(self.device), *rows])

    def _shard_audit(self, step: int, own: _ShardPass) -> None:
        """The ring audit: recompute the audited rank's step (every rank at once), send it, compare ours."""
        own.own_record = self._record(own.loss, own.seen)
        own.audit_record = self._recompute_record(step, self.audits)
        theirs = torch.empty_like(own.own_record)
        if own.audit_record.shape != own.own_record.shape:
            raise RuntimeError("ring audit: the recomputation reduce-scattered a different number of FSDP groups "
                               f"({own.audit_record.numel()} vs {own.own_record.numel()} record entries)")
        ops = [dist.P2POp(dist.isend, own.audit_record, self.audits),
               dist.P2POp(dist.irecv, theirs, self.audited_by)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        own.audit_bad = (theirs != own.own_record).any()

    def _recompute_record(self, step: int, owner: int) -> torch.Tensor:
        """``owner``'s loss bits and per-FSDP-group local-gradient fingerprints, recomputed here; changes nothing.

        A collective within the shard group, so every rank calls it at once (see :meth:`_recompute_pass`).
        """
        return self._record(*self._recompute_pass(step, owner, record=True))

    def _recompute_pass(self, step: int, owner: int, *, record: bool) -> tuple[torch.Tensor, _Seen]:
        """``owner``'s step recomputed here: its loss and what its reduce-scatter inputs showed; changes nothing.

        A collective within the shard group (FSDP all-gathers the parameters), so every rank calls it at once.
        The reduce-scatters are answered locally and the replicas' all-reduce is off, so nothing is sent; the
        sharded gradients of this step are set aside and put back, and FSDP's partial-reduce state is restored.
        """
        params = list(self.model.parameters())
        kept = [p.grad for p in params]
        partial = _partial_outputs(self.model)
        seen_before = self.shard_hook.seen
        for p in params:
            p.grad = None
        seen = self.shard_hook.begin(record=record)
        self.shard_hook.communicate = False
        # Without a way to drop the partial reduction FSDP would keep, the replicas' all-reduce stays on
        # (it sums zeros: correct, one wasted all-reduce of a shard).
        quiet = self.replicated and len(partial) == len(_param_groups(self.model))
        if quiet:
            self.fsdp.set_requires_all_reduce(False)
        try:
            with preserved(self.model):
                loss = self._fsdp_pass(step, owner)
        finally:
            self.shard_hook.communicate = True
            if quiet:
                self.fsdp.set_requires_all_reduce(True)
            _restore_partial_outputs(partial)
            for p, g in zip(params, kept, strict=True):
                p.grad = g
            self.shard_hook.seen = seen_before
        return loss, seen

    def _shard_agree(self, own: _ShardPass) -> bool:
        """The step's one collective: flags, and each shard position's reduced lanes (MAX of x and of ~x)."""
        cfg = self.config
        flags = self._flags(own)
        slots = torch.full((2, self.shards, fp.LANES), _LOWEST, dtype=torch.int64, device=self.device)
        if cfg.reduced_grad:
            s = self.coordinate[1]
            slots[0, s] = own.reduced_lanes
            slots[1, s] = torch.bitwise_not(own.reduced_lanes)
        vector = torch.cat([flags, slots.reshape(-1)])
        dist.all_reduce(vector, op=dist.ReduceOp.MAX)
        v = vector.cpu()
        width = self.shards * fp.LANES
        high, low = v[FLAGS:FLAGS + width], torch.bitwise_not(v[FLAGS + width:])
        return not bool(v[:FLAGS].any()) and bool((high == low).all())

    def _flags(self, own: _ShardPass) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.bool, device=self.device)
        return torch.stack([own.local_any, own.reduced_any, own.loss_nonfinite,
                            own.audit_bad if own.audit_bad is not None else zero,
                            own.trigger if own.trigger is not None else zero]).to(self.device, torch.int64)

    def _claim(self, loss: torch.Tensor, seen: _Seen, *, digests: bool) -> torch.Tensor:
        """A rank's claim about one pass (``agent.confirm``'s layout): loss bits, the mask of non-finite FSDP
        groups, each group's local-gradient norm bits, and with ``digests`` each group's fingerprint."""
        parts = [loss_bits(loss).reshape(1).to(self.device), _mask(seen, self.device).reshape(1)]
        if seen.norms:
            norms = torch.stack(seen.norms)
            # One NaN, whatever the payload the arithmetic left: a data fault's claim must match its recomputation.
            norms = torch.where(torch.isnan(norms), torch.full_like(norms, math.nan), norms)
            parts.append(confirm.float_bits(norms).to(self.device))
        if digests:
            parts += [r.to(self.device).reshape(-1) for r in seen.rows]
        return torch.cat(parts)

    def _shard_resolve(self, step: int, own: _ShardPass, result: StepResult) -> Alarm | None:
        """Something disagreed: gather every rank's row, confirm before blaming, decide (the same on every rank).

        Returns the alarm, or None with ``result.data_fault`` set when the update must be skipped without one,
        or None alone when the step may update (a magnitude jump the recomputations reproduced).
        """
        cfg, world = self.config, self.topology.world_size
        digests = own.own_record is not None
        row = torch.cat([self._flags(own), own.reduced_lanes.to(self.device), _mask(own.seen, self.device).reshape(1),
                         self._claim(own.loss, own.seen, digests=digests)])
        rows = self._all_gather(row)
        claims = rows[:, ROW_CLAIM:]
        local_ranks = torch.nonzero(rows[:, ROW_LOCAL]).reshape(-1).tolist()
        reduced_ranks = torch.nonzero(rows[:, ROW_REDUCED]).reshape(-1).tolist()
        loss_ranks = torch.nonzero(rows[:, ROW_LOSS]).reshape(-1).tolist()
        if cfg.reduced_grad and not reduced_ranks:
            verdict = self._vote_by_shard(rows[:, ROW_LANES])
            if not verdict.unanimous:
                suspects = verdict.dissenters
                return self._alarm(step, Detector.REDUCED_GRAD, suspects, verdict.localized,
                                   fingerprint_evidence("reduced_grad", verdict.groups(), verdict.majority(),
                                                        "reduced_gradients"),
                                   f"replicas hold different reduced gradient shards; outside the majority: "
                                   f"{suspects}" if verdict.localized else
                                   "replicas hold different reduced gradient shards and no strict majority")
        owners: dict[int, list[str]] = {}
        nonfinite = None
        if cfg.nonfinite and (local_ranks or loss_ranks or reduced_ranks):
            groups = [(r, g, "local") for r in local_ranks for g in range(MASK_GROUPS)
                      if int(rows[r, ROW_LOCAL_MASK]) >> g & 1]
            nonfinite = _MeshNonfinite(local_ranks, loss_ranks, reduced_ranks, groups[:4096])
            bad = sorted(set(local_ranks) | set(loss_ranks))
            if not bad:
                # Finite inputs everywhere, non-finite shards: the reduction itself.
                strict = 0 < len(reduced_ranks) < world
                suspects = reduced_ranks if strict else []
                return self._alarm(step, Detector.NONFINITE_GRAD, suspects, bool(suspects),
                                   nonfinite_evidence([], True, [(r, 0, "reduced") for r in reduced_ranks][:4096]),
                                   f"the reduction delivered non-finite gradient shards to rank(s) {reduced_ranks}")
            for r in bad:
                owners.setdefault(r, []).append(confirm.NONFINITE)
        for r in torch.nonzero(rows[:, ROW_TRIGGER]).reshape(-1).tolist():
            owners.setdefault(r, []).append(confirm.MAGNITUDE)
        audit = None
        if digests and bool(rows[:, ROW_AUDIT_BAD].any()):
            audit = self._judge_shard_audit(own)
            for pair in audit.mismatched:
                owners.setdefault(pair.audited, []).append(confirm.AUDIT)
        return self._confirm_and_decide(step, result, claims, owners, nonfinite, audit, own.seen.names)

    def _param_label(self, name: str) -> str:
        """How an alarm names a digest that disagreed: under a mesh, the FSDP group's."""
        return f"FSDP group {name}"

    def _nonfinite_evidence(self, nonfinite: _MeshNonfinite) -> NonFiniteEvidence:
        """Detector 1's evidence from its reading of the gathered rows (under a mesh: per FSDP group)."""
        return nonfinite_evidence(nonfinite.local_ranks, bool(nonfinite.reduced_ranks), nonfinite.groups)

    def _nonfinite_named(self, nonfinite: _MeshNonfinite) -> list[int]:
        """The ranks an unconfirmed non-finite alarm names: under a mesh, those with non-finite local gradients
        and those with a non-finite loss."""
        return sorted(set(nonfinite.local_ranks) | set(nonfinite.loss_ranks))

    def _confirm(self, step: int, claims: torch.Tensor, owners: dict[int, tuple[str, ...]], *,
                 digests: bool) -> _Confirmation:
        """Recompute each owner's micro-batch on its confirmers, in lock step, gather, judge.

        Every rank runs one pass per confirmation slot (a forward through the FSDP model is a collective of
        the shard group): its assignment in that slot, or its own micro-batch when it has none.
        """
        rank, width = self.topology.rank, claims.shape[1]
        assigned = dict(self.ring.assignments(rank, set(owners)))
        mine = torch.zeros(2, 1 + width, dtype=torch.int64, device=self.device)
        # Every owner's previous unit recomputes it in slot 0; with 3 or more units the next one in slot 1.
        for slot in range(2 if self.ring.units >= 3 else 1):
            owner = assigned.get(slot)
            loss, seen = self._recompute_pass(step, rank if owner is None else owner, record=digests)
            if owner is not None:
                mine[slot, 0] = 1
                mine[slot, 1:] = self._claim(loss, seen, digests=digests)
        records = self._all_gather(mine.reshape(-1)).reshape(-1, 2, 1 + width)
        return _Confirmation(confirm.judge_confirmations(claims, records, owners, self.ring), claims, records)

    def _persistence(self, step: int, c: _Confirmation, *, digests: bool) -> FaultPersistence:
        """Each localised suspect replays once the micro-batch it got wrong; every other rank its own (a pass
        in lock step, the result unused)."""
        plan = confirm.replay_plan(c.verdict)
        if not plan:
            return "unknown"
        rank = self.topology.rank
        mine = torch.zeros(1 + c.claims.shape[1], dtype=torch.int64, device=self.device)
        loss, seen = self._recompute_pass(step, plan[rank].owner if rank in plan else rank, record=digests)
        if rank in plan:
            mine[0] = 1
            mine[1:] = self._claim(loss, seen, digests=digests)
        return confirm.persistence(self._all_gather(mine), plan, c.claims, c.records, self.ring)

    def _judge_shard_audit(self, own: _ShardPass) -> AuditVerdict:
        assert own.own_record is not None
        assert own.audit_record is not None
        both = self._all_gather(torch.cat([own.own_record, own.audit_record]))
        width = both.shape[1] // 2
        return judge_audit(both[:, :width], both[:, width:], self.stride, names=own.seen.names)

    # -- detector 3 -----------------------------------------------------------------------------------

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

    def local_fingerprint(self) -> torch.Tensor:
        """The fingerprint lanes of :meth:`local_state`."""
        tensors = self.local_state()
        if not tensors:
            return torch.zeros(fp.LANES, dtype=torch.int64, device=self.device)
        return fp.combine(packed_fingerprints(tensors)).to(self.device)

    def local_fingerprint_hex(self) -> str:
        """This rank's shard fingerprint as hex (what a checkpoint's manifest holds for its shard position)."""
        return fp.to_hex(self.local_fingerprint())

    def _vote_by_shard(self, rows: torch.Tensor) -> ShardVerdict:
        """A strict-majority vote among the replicas of each shard position (``rows``: ``[world, LANES]``)."""
        holders = self.mesh_ranks()
        votes = []
        for s in range(self.shards):
            ranks = [holders[g][s] for g in range(self.replicas)]
            ballot = vote(rows[ranks])
            groups = [(h, [ranks[i] for i in members]) for h, members in ballot.groups]
            votes.append(Vote(groups=groups, majority=ballot.majority))
        return ShardVerdict(votes=votes, rows=rows, holders=holders)

    def mesh_ranks(self) -> list[list[int]]:
        """``[G][S]``: the global rank holding shard position s in replica group g."""
        return [[g * self.shards + s for s in range(self.shards)] for g in range(self.replicas)]

    def _shard_state(self) -> tuple[ShardVerdict, list[str]]:
        rows = self._all_gather(self.local_fingerprint())
        verdict = self._vote_by_shard(rows)
        return verdict, [v.groups[0][0] for v in verdict.votes]

    def state_fingerprint_hex(self) -> str:
        """The one digest of every shard that all replicas agree on (a collective); "replicas-disagree" else."""
        verdict, first = self._shard_state()
        if not verdict.unanimous:
            return "replicas-disagree"
        return _combined(first)

    def agreed_fingerprint(self, step: int) -> tuple[str | None, Alarm | None]:
        """Compare every shard across its replicas (a collective: every rank calls it).

        Returns (one digest of all shards, in shard order, None) when every
        shard's replicas agree, with the per-shard fingerprints kept in
        ``agreed_shards``; else (None, the alarm). Without replicas there is
        nothing to compare: the digest of the shards as they are.
        """
        verdict, first = self._shard_state()
        if verdict.unanimous:
            self.agreed_shards = first
            if self.replicated:
                self.last_clean[Detector.WEIGHT_FINGERPRINT.value] = step
            return _combined(first), None
        suspects = verdict.dissenters
        alarm = self._alarm(step, Detector.WEIGHT_FINGERPRINT, suspects, verdict.localized,
                            fingerprint_evidence("weight_fingerprint", verdict.groups(), verdict.majority(),
                                                 "weights+optimizer"),
                            f"replicas hold different shards; outside the strict majority: {suspects}"
                            if verdict.localized else "replicas hold different shards and no strict majority")
        return None, alarm

    # -- checkpoints ----------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> ShardedCheckpointWriter:  # type: ignore[override]
        """The job's sharded (DCP) checkpoint writer on ``config.checkpoint_prefix`` (made on first use)."""
        if self._checkpoints is None:
            from agent.sharded_checkpoint import ShardedCheckpointWriter

            injection, topo = self.injector.injection, self.topology
            corrupt = None
            if injection is not None and injection.kind == "checkpoint_corrupt":
                corrupt = functools.partial(corrupt_checkpoint_bytes, node=topo.node, injection=injection)
            self._checkpoints = cast("Any", ShardedCheckpointWriter(
                self.config.checkpoint_prefix, guard=self, corrupt=corrupt,
                written_by=f"sdcguard agent rank {topo.rank} on {topo.host}"[:256]))
        return cast("ShardedCheckpointWriter", self._checkpoints)


class _Wrapped:
    """Gives the FSDP model the ``.module`` a DDP model has (what the injector hooks)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


def _mask(seen: _Seen, device: torch.device) -> torch.Tensor:
    """The bit mask of the FSDP groups (the first MASK_GROUPS) whose reduce-scatter input was non-finite."""
    if not seen.flags:
        return torch.zeros((), dtype=torch.int64, device=device)
    flags = torch.stack(seen.flags[:MASK_GROUPS]).to(device, torch.int64)
    return (flags << torch.arange(flags.numel(), device=device)).sum()


def _local_norm(seen: _Seen, device: torch.device) -> torch.Tensor:
    """This rank's local-gradient norm over every FSDP group (what the magnitude trigger watches)."""
    if not seen.norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.linalg.vector_norm(torch.stack(seen.norms))


def _combined(shard_hexes: Sequence[str]) -> str:
    rows = torch.stack([_lanes_of(h) for h in shard_hexes])
    return fp.to_hex(fp.combine(rows))


def _lanes_of(hex_fingerprint: str) -> torch.Tensor:
    raw = bytes.fromhex(hex_fingerprint)
    return torch.tensor([int.from_bytes(raw[i:i + 8], "big", signed=True) for i in range(0, len(raw), 8)],
                        dtype=torch.int64)


def _check_mesh(mesh: DeviceMesh | None) -> tuple[DeviceMesh, int, int]:
    """(mesh, replica groups, shards per group); ValueError naming ``mesh`` when it does not fit."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError("mesh: must be a torch.distributed.device_mesh.DeviceMesh")
    if mesh.ndim == 2:
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(f"mesh: a 2-D mesh must have dims {MESH_DIMS}, got {mesh.mesh_dim_names}")
        replicas, shards = mesh.shape
    elif mesh.ndim == 1:
        replicas, shards = 1, mesh.shape[0]
    else:
        raise ValueError(f"mesh: must be 1-D (FSDP) or 2-D (HSDP), got {mesh.ndim}-D")
    world = dist.get_world_size()
    if mesh.mesh.reshape(-1).tolist() != list(range(world)):
        raise ValueError(f"mesh: must span the world rank by rank (as init_device_mesh lays it out), got "
                         f"{mesh.mesh.tolist()} for a world of {world}")
    return mesh, int(replicas), int(shards)


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

