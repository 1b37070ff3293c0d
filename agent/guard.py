"""SDCGuard: one checked training step (forward, backward, detectors, confirmation, update or skip).

Order inside a step; nothing reaches ``optimizer.step()`` unchecked:

1. On weight-check steps, detector 3 compares the fingerprints of the weights
   (trainable and frozen), the optimizer state and the buffers DDP keeps equal
   (the state after the updates of steps ``0 .. step-1``); a mismatch skips
   the whole step.
2. Seed the random state for (step, rank), then forward (under autocast when
   ``autocast_dtype`` is set) and backward through DDP for each of the K
   micro-batches (each loss divided by K, ``no_sync`` for all but the last);
   on the last backward the communication hook sees the accumulated local
   gradients and checks local and reduced gradients (detector 1),
   takes each bucket's local-gradient norm, fingerprints the reduced
   gradients, and on audit steps records per-parameter local-gradient
   fingerprints.
3. On audit steps, recompute the audited rank's whole step, all K
   micro-batches (detector 2), and send the record to its owner, who compares.
4. The magnitude trigger compares this rank's loss and gradient norm with its
   own history.
5. One small all-reduce (flags, and the min and max of the reduced-gradient
   fingerprint) tells every rank whether all agree: O(1) in the world size.
   Only when something disagrees are the ranks' findings gathered
   (:meth:`SDCGuard._resolve`), and a suspicious micro-batch is recomputed on
   other nodes before anything is blamed (agent.confirm): the same data fault
   on any GPU is the data's; a recomputation that differs is the hardware's,
   and the suspect replays once to say whether it persists.
6. Update (unscale, clip to ``max_grad_norm``, ``optimizer.step()`` or the
   GradScaler's step, then the LR scheduler's step), or skip it all: on an
   alarm (publish, then the policy), on a data fault (every rank skips, a
   warning names the rank), on a GradScaler overflow.

Every recomputation restores the module's buffers and the random state, so
checking changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from agent import confirm, native, replay
from agent.alarm import (
    RankIdentity,
    build_alarm,
    fingerprint_evidence,
    gather_identities,
    nonfinite_evidence,
    ring_evidence,
)
from agent.checkpoint import CheckpointSaveFailed, CheckpointWriter, LoadedCheckpoint, SaveResult
from agent.config import ALARM_EXIT_CODE, GuardConfig
from agent.inject import Injection, Injector, corrupt_checkpoint_bytes
from agent.inject import from_env as injection_from_env
from agent.nonfinite import (
    LOCAL_ANY,
    LOSS_NONFINITE,
    REDUCED_ANY,
    REDUCED_FP,
    SUMMARY_WIDTH,
    GradientHook,
    judge_nonfinite,
)
from agent.publisher import Publisher, PublishOutcome
from agent.ring_audit import AuditVerdict, audit_record, layout_order, owner_record, preserved, recompute_step
from agent.ring_audit import judge as judge_audit
from agent.topology import Topology
from agent.trigger import MagnitudeTrigger
from agent.weights import checked_buffers, state_fingerprint, state_fingerprint_hex, vote
from contract import Alarm, Detector, LastClean, NonFiniteEvidence, RingPair
from contract.alarm import FaultPersistence

log = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
BatchFor = Callable[[int, int], Any]

LOOP_STATE = "sdcguard_loop"
"""The key of a checkpoint's ``extra`` under which the guard keeps the LR schedule's and the GradScaler's state."""

# The gathered row of one rank (only on disagreement): its summary, then these, then its claim.
ROW_TRIGGER, ROW_AUDIT_BAD = SUMMARY_WIDTH, SUMMARY_WIDTH + 1
ROW_CLAIM = SUMMARY_WIDTH + 2

# The per-step all-reduce (MAX): flags, then the reduced-gradient lanes and their complements (~x: a MAX of
# ~x is the complement of the MIN, with no overflow), so every rank sees whether all lanes agree.
AGREE_LOCAL, AGREE_REDUCED, AGREE_LOSS, AGREE_TRIGGER, AGREE_AUDIT = range(5)
AGREE_FLAGS = 5


class GuardAlarm(RuntimeError):
    """Raised by ``SDCGuard.step`` under ``on_alarm="raise"``; ``.alarm`` is the published alarm."""

    def __init__(self, alarm: Alarm) -> None:
        super().__init__(f"SDC alarm at step {alarm.step} ({alarm.detector.value}): suspects {alarm.suspect_ranks}")
        self.alarm = alarm


class DataFaultLimit(RuntimeError):
    """Raised on every rank after more than ``max_data_faults`` consecutive data faults: the run is broken
    (its data, its learning rate), not the hardware. ``.ranks`` and ``.step`` say where it last happened."""

    def __init__(self, step: int, ranks: list[int], streak: int, limit: int) -> None:
        super().__init__(f"{streak} consecutive steps (the last at step {step}, rank(s) {ranks}) had non-finite "
                         f"gradients that a recomputation on another node reproduced: the data or the training "
                         f"setup is at fault, not the hardware (max_data_faults={limit})")
        self.step = step
        self.ranks = ranks


@dataclass
class StepResult:
    """What one guarded step did."""

    step: int
    loss: float
    """This rank's loss, the mean over its micro-batches (NaN when the step was skipped before the forward)."""
    grad_norm: float = math.nan
    """The global norm of the reduced gradients before clipping (unscaled, with a GradScaler): what
    ``clip_grad_norm_`` returned when ``max_grad_norm`` is set, else the communication hook's measure.
    NaN when not measured: the step stopped before the backward, or clipping is on and it skipped the update."""
    alarm: Alarm | None = None
    """The alarm raised at this step, or None."""
    updated: bool = False
    """Whether the optimizer applied this step's update."""
    audited: bool = False
    weights_checked: bool = False
    overflow: bool = False
    """The GradScaler skipped the update (its overflow): no alarm."""
    data_fault: bool = False
    """Non-finite gradients or loss that a recomputation on another node reproduced: the data's, not the
    hardware's. The update was skipped on every rank (with a GradScaler: its skip and backoff); True on every rank."""
    confirmed: list[int] = field(default_factory=list)
    """Ranks whose micro-batch was recomputed on other nodes this step to confirm a finding (same on every rank)."""
    triggered: bool = False
    """This rank's magnitude trigger fired (it only asks for a confirmation)."""
    published: PublishOutcome | None = None
    """On the publishing rank, what became of the alarm."""


@dataclass
class _Pass:
    """What the rank's own forward and backward left for the verdict."""

    loss: torch.Tensor
    summary: torch.Tensor
    own_record: torch.Tensor | None = None
    audit_record: torch.Tensor | None = None
    audit_bad: torch.Tensor | None = None
    trigger: torch.Tensor | None = None


@dataclass(frozen=True)
class _Confirmation:
    """The confirmations' verdict, and the gathered claims and records it was judged from."""

    verdict: confirm.ConfirmationVerdict
    claims: torch.Tensor
    records: torch.Tensor


class SDCGuard:
    """Wraps a DDP model and its optimizer; ``step(step)`` runs one checked training step.

    ``loss_fn(module, batch)`` returns the scalar loss of one micro-batch;
    ``batch_for(step, rank)`` returns the exact micro-batch ``rank`` trains on at
    ``step`` (with ``grad_accum_steps`` K > 1, a sequence of K of them); the ring
    audit and confirmations recompute other ranks' steps with it. ``scaler``
    is an optional ``torch.amp.GradScaler`` (a disabled one counts as none);
    ``scheduler`` an optional LR scheduler, stepped once after each applied
    update and never on a skipped step; both are saved in every checkpoint and
    restored by :meth:`resume_step`. ``injection`` defaults to
    ``SDCGUARD_INJECT``. ``unchecked_buffers`` names buffers the weight
    fingerprint must leave out. Raises ``ValueError`` for a model that is not
    DDP-wrapped or a bad setting.

    With ``mesh`` (a ``DeviceMesh``), ``model`` is an FSDP2 model
    (``fully_shard(..., mesh=mesh)``) and the guard is an
    :class:`agent.sharded.ShardedGuard`.
    """

    def __new__(cls, *args: Any, mesh: Any = None, **kwargs: Any) -> SDCGuard:
        if mesh is not None and cls is SDCGuard:
            from agent.sharded import ShardedGuard  # imports this module: only when asked for

            return super().__new__(ShardedGuard)
        return super().__new__(cls)

    def __init__(
        self,
        model: torch.nn.parallel.DistributedDataParallel,
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
        checkpoints: CheckpointWriter | None = None,
        unchecked_buffers: tuple[str, ...] = (),
        mesh: Any = None,
    ) -> None:
        if mesh is not None:
            raise ValueError("mesh: only for an FSDP2 model (SDCGuard builds a ShardedGuard for it)")
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("model: must be a torch.nn.parallel.DistributedDataParallel")
        self.config = cfg = config if config is not None else GuardConfig.from_env()
        replay.pin_threads(cfg.threads)
        # Build (or load) the fingerprint kernel now, on the main thread: not on a
        # gloo thread in the middle of the first step; a bad setting fails here.
        native.kernel()
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        # A disabled GradScaler (GradScaler(enabled=False), the usual "fp16 only" switch) scales nothing.
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scheduler = scheduler
        self.group = group
        self.topology = Topology.from_env(ranks_per_node=cfg.ranks_per_node,
                                          rank=dist.get_rank(group), world_size=dist.get_world_size(group))
        self.ring = confirm.Ring.of(self.topology.world_size, self.topology.ranks_per_node)
        self.publisher = publisher if publisher is not None else Publisher(cfg)
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frozen_names = [n for n, p in model.module.named_parameters() if not p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.audit_enabled = cfg.audit_every > 0 and self.topology.nodes >= 2
        if cfg.deterministic and self.audit_enabled:
            replay.use_deterministic_algorithms(self.device)
        # The settling pass runs the first micro-batch the way every step runs its last (autocast, synchronised).
        changed = _settle_buckets(model, self._forward, self._micro_batches(0, dist.get_rank(group))[0])
        self.buffer_names = checked_buffers(model, changed, set(unchecked_buffers))
        """Buffers the weight fingerprint covers (DDP broadcasts them and a forward leaves them alone)."""
        self._step_hooks: list[Callable[[int], None]] = []
        self._stepped = False
        optimizer.register_step_post_hook(self._on_optimizer_step)
        self.hook = GradientHook({id(p): n for n, p in named}, self.topology.world_size, group)
        self.hook.check_nonfinite = cfg.nonfinite
        self.hook.check_reduced = cfg.reduced_grad
        self.hook.measure_norms = cfg.trigger_ratio > 0 or cfg.confirm
        # With clipping, clip_grad_norm_ measures the norm itself.
        self.hook.measure_reduced_norm = cfg.max_grad_norm is None
        self.hook.register(model)
        self.trigger = (MagnitudeTrigger(cfg.trigger_ratio, cfg.trigger_window, cfg.trigger_warmup, self.device)
                        if cfg.trigger_ratio > 0 else None)
        if isinstance(injection, str):
            injection = injection_from_env()
        self.injector = Injector(injection, self.topology.rank, self.topology.node)
        self.injector.install(self)
        self.identities: list[RankIdentity] = gather_identities(self.topology, self.device, group)
        self.run_id = self._agree_run_id()
        if cfg.audit_every > 0 and not self.audit_enabled:
            log.warning("ring audit off: it needs ranks on at least 2 nodes (world %d, %d ranks per node)",
                        self.topology.world_size, self.topology.ranks_per_node)
        self.last_clean: dict[str, int | None] = {d.value: None for d in Detector}
        self.overflow_streak = 0
        self.data_fault_streak = 0
        self.alarms: list[Alarm] = []
        self._checkpoints = checkpoints
        self.resumed: LoadedCheckpoint | None = None
        self.republished: dict[str, PublishOutcome] = {}
        """What became of the alarms an earlier start had spooled (republished by rank 0 when built)."""
        if self.topology.rank == 0:
            self.republished = self.publisher.republish_spooled()

    def register_step_hook(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(step)`` at the start of every step (fault injection, profilers)."""
        self._step_hooks.append(hook)

    # -- the step -------------------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        """Run training step ``step`` with every due check; update only if all passed.

        Returns the StepResult. On an alarm the update is skipped and the alarm
        published, then ``on_alarm`` applies: "stop" exits the process with
        ALARM_EXIT_CODE, "raise" raises GuardAlarm, "continue" returns it in
        the result. Raises DataFaultLimit after more than ``max_data_faults``
        consecutive data faults.
        """
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        for hook in self._step_hooks:
            hook(step)
        cfg = self.config
        result = StepResult(step=step, loss=math.nan)
        if cfg.fingerprint_every and step % cfg.fingerprint_every == 0:
            result.weights_checked = True
            alarm = self._check_weights(step)
            if alarm is not None:
                return self._handle(alarm, result)
        result.audited = self.audit_enabled and step % cfg.audit_every == 0
        own = self._forward_backward(step, result.audited)
        if result.audited:
            self._audit(step, own)
        if self.trigger is not None:
            own.trigger = self.trigger.fires(own.loss, self._grad_norm())
        agreed = self._agree(own)
        result.loss = float(own.loss.detach())
        if self.hook.measure_reduced_norm:
            result.grad_norm = float(self._unscaled(self.hook.reduced_norm(self.device)))
        result.triggered = bool(own.trigger) if own.trigger is not None else False
        if agreed:
            return self._update(step, result)
        alarm = self._resolve(step, own, result)
        if alarm is not None:
            return self._handle(alarm, result)
        if result.data_fault or result.overflow:
            self._apply_update(overflow=True)
            return result
        return self._update(step, result)

    def _forward_backward(self, step: int, audited: bool) -> _Pass:
        """The rank's own pass through DDP: every micro-batch's forward (under autocast) and backward, its loss
        divided by K, DDP synchronising on the last only; so the communication hook sees the accumulated local
        gradients before their all-reduce, and checks as they are reduced. The loss is the mean."""
        self.optimizer.zero_grad(set_to_none=True)
        replay.seed_micro_batch(self.config.seed, step, self.topology.rank)
        self.hook.begin_step(record_params=audited)
        batches = self._micro_batches(step, self.topology.rank)
        k = len(batches)
        total: torch.Tensor | None = None
        for i, batch in enumerate(batches):
            with contextlib.nullcontext() if i == k - 1 else self.model.no_sync():
                loss = self._forward(self.model, batch)
                if k > 1:
                    loss = loss / k
                self._scaled(loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return _Pass(loss=total, summary=self.hook.summary(total, self.device))

    def _forward(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        """``loss_fn`` under ``torch.autocast`` when ``autocast_dtype`` is set: every forward the guard runs."""
        with self._autocast():
            return self.loss_fn(module, batch)

    def _micro_batches(self, step: int, rank: int) -> list[Any]:
        """``batch_for(step, rank)`` as a list of K micro-batches (ValueError when it returns another count)."""
        k = self.config.grad_accum_steps
        batch = self.batch_for(step, rank)
        if k == 1:
            return [batch]
        batches = list(batch)
        if len(batches) != k:
            raise ValueError(f"batch_for: returned {len(batches)} micro-batches for step {step}, rank {rank}; "
                             f"grad_accum_steps is {k}")
        return batches

    def _audit(self, step: int, own: _Pass) -> None:
        """Detector 2: recompute the next node's micro-batch, send the record to its owner, compare ours."""
        topo = self.topology
        own.own_record = owner_record(own.loss, self.hook, self.device)
        recomputation = self._recompute(step, topo.audits)
        own.audit_record = audit_record(recomputation, self.hook.layout, self.device)
        del recomputation  # digests, not copies, outlive the recomputation
        theirs = torch.empty_like(own.own_record)
        if topo.world_size > 1:
            ops = [dist.P2POp(dist.isend, own.audit_record, self._global(topo.audits), self.group),
                   dist.P2POp(dist.irecv, theirs, self._global(topo.audited_by), self.group)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        else:
            theirs = own.audit_record
        own.audit_bad = (theirs != own.own_record).any()

    def _recompute(self, step: int, owner: int) -> Any:
        """``owner``'s whole step (all K micro-batches) on the bare module, bit for bit as its own pass ran it."""
        seed = functools.partial(replay.seed_micro_batch, self.config.seed, step, owner)
        return recompute_step(self.model.module, self.loss_fn, self._micro_batches(step, owner), self.names,
                              self.params, seed, scale=self._scaled, autocast=self._autocast)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.config.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype))

    def _grad_norm(self) -> torch.Tensor:
        """This rank's local-gradient norm (unscaled under a GradScaler), on the device, fp64."""
        return self._unscaled(torch.linalg.vector_norm(self.hook.bucket_norms(self.device)))

    def _unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        """A norm of scaled gradients divided by the GradScaler's scale (unchanged without one)."""
        if self.scaler is None:
            return norm
        # The scale tensor itself (not get_scale(), which would synchronise with the host).
        scale = getattr(self.scaler, "_scale", None)
        return norm / (scale.to(norm) if isinstance(scale, torch.Tensor) else self.scaler.get_scale())

    def _agree(self, own: _Pass) -> bool:
        """The step's one collective while all is well: does every rank agree? (the same answer on every rank)."""
        cfg, s = self.config, own.summary
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        flags = torch.stack([
            (s[LOCAL_ANY] > 0).to(torch.int64) if cfg.nonfinite else zero,
            (s[REDUCED_ANY] > 0).to(torch.int64) if cfg.nonfinite else zero,
            s[LOSS_NONFINITE] if cfg.nonfinite else zero,
            own.trigger.to(torch.int64) if own.trigger is not None else zero,
            own.audit_bad.to(torch.int64) if own.audit_bad is not None else zero,
        ])
        lanes = s[REDUCED_FP] if cfg.reduced_grad else torch.zeros(3, dtype=torch.int64, device=self.device)
        vector = torch.cat([flags, lanes, torch.bitwise_not(lanes)])
        if self.topology.world_size > 1:
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group)
        v = vector.cpu()
        low = torch.bitwise_not(v[AGREE_FLAGS + 3:])
        return not bool(v[:AGREE_FLAGS].any()) and bool((v[AGREE_FLAGS:AGREE_FLAGS + 3] == low).all())

    def _update(self, step: int, result: StepResult) -> StepResult:
        """Every check passed (or a trigger was confirmed as real): record the clean steps and update."""
        cfg = self.config
        if cfg.nonfinite:
            self.overflow_streak = 0
            self.data_fault_streak = 0
            self.last_clean[Detector.NONFINITE_GRAD.value] = step
        if cfg.reduced_grad:
            self.last_clean[Detector.REDUCED_GRAD.value] = step
        if result.audited:
            self.last_clean[Detector.RING_AUDIT.value] = step
        if self.trigger is not None:
            self.trigger.observe()
        result.updated = self._apply_update(overflow=False, result=result)
        if result.updated and self.scheduler is not None:
            self.scheduler.step()
        return result

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _apply_update(self, *, overflow: bool, result: StepResult | None = None) -> bool:
        """Update (unscale, clip, step), or let the GradScaler skip, or skip; whether the optimizer stepped."""
        self._stepped = False
        if self.scaler is not None:
            if not overflow:
                self.scaler.unscale_(self.optimizer)
                self._clip(result)
            # On an overflow (or a data fault) every rank's reduced gradients are non-finite,
            # so the scaler skips the update and backs off on every rank alike.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not overflow:
            self._clip(result)
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return self._stepped

    def _clip(self, result: StepResult | None) -> None:
        """Clip the reduced (and unscaled) gradients to ``max_grad_norm``; the norm before clipping is the
        step's ``grad_norm``. Every rank holds the same reduced gradients, so all clip alike."""
        if self.config.max_grad_norm is None:
            return
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        if result is not None:
            result.grad_norm = float(norm)

    def _on_optimizer_step(self, *_: Any) -> None:
        # GradScaler.step calls optimizer.step only when the gradients were finite: this says which.
        self._stepped = True

    # -- the disagreement path ------------------------------------------------------------------------

    def _resolve(self, step: int, own: _Pass, result: StepResult) -> Alarm | None:
        """Something disagreed: gather every rank's findings, confirm before blaming, decide (same on every rank).

        Returns the alarm, or None with ``result.overflow`` / ``result.data_fault``
        set when the update must be skipped without one, or None alone when the
        step may update (a magnitude jump that the recomputation reproduced).
        """
        cfg, world = self.config, self.topology.world_size
        claim = confirm.claim_from_hook(own.loss, self.hook, self.device, digests=own.own_record is not None)
        row = torch.cat([own.summary, torch.stack([
            own.trigger.to(torch.int64) if own.trigger is not None else torch.zeros((), dtype=torch.int64),
            own.audit_bad.to(torch.int64) if own.audit_bad is not None else torch.zeros((), dtype=torch.int64),
        ]).to(self.device), claim])
        rows = self._all_gather(row)
        summaries = rows[:, :SUMMARY_WIDTH]
        claims = rows[:, ROW_CLAIM:]
        # A step with non-finite sums belongs to the non-finite check (their bits carry no meaning).
        if cfg.reduced_grad and not bool(summaries[:, REDUCED_ANY].any()):
            ballot = vote(summaries[:, REDUCED_FP])
            if not ballot.unanimous:
                suspects = ballot.dissenters
                return self._alarm(step, Detector.REDUCED_GRAD, suspects, ballot.majority is not None,
                                   fingerprint_evidence("reduced_grad", ballot.groups, ballot.majority,
                                                        "reduced_gradients"),
                                   f"ranks received different reduced gradients; outside the majority: {suspects}")
        owners: dict[int, list[str]] = {}
        nonfinite = judge_nonfinite(summaries) if cfg.nonfinite else None
        if nonfinite is not None and (nonfinite.local_ranks or nonfinite.loss_ranks or nonfinite.reduced_ranks):
            everyone = len(nonfinite.local_ranks) == world
            if self.scaler is not None and everyone and not nonfinite.loss_ranks:
                return self._scaler_overflow(step, result, nonfinite)
            bad = sorted(set(nonfinite.local_ranks) | set(nonfinite.loss_ranks))
            if not bad:
                # Finite inputs everywhere, non-finite sums: the collective itself.
                strict = 0 < len(nonfinite.reduced_ranks) < world
                suspects = nonfinite.reduced_ranks if strict else []
                return self._alarm(step, Detector.NONFINITE_GRAD, suspects, bool(suspects),
                                   nonfinite_evidence([], True, nonfinite.buckets),
                                   f"the all-reduce delivered non-finite gradients to rank(s) {nonfinite.reduced_ranks}")
            for r in bad:
                owners.setdefault(r, []).append(confirm.NONFINITE)
        for r in torch.nonzero(rows[:, ROW_TRIGGER]).reshape(-1).tolist():
            owners.setdefault(r, []).append(confirm.MAGNITUDE)
        audit = None
        if own.own_record is not None and bool(rows[:, ROW_AUDIT_BAD].any()):
            audit = self._judge_audit(own)
            for pair in audit.mismatched:
                owners.setdefault(pair.audited, []).append(confirm.AUDIT)
        return self._confirm_and_decide(step, result, claims, owners, nonfinite, audit,
                                        layout_order(self.hook.layout))

    def _scaler_overflow(self, step: int, result: StepResult, nonfinite: Any) -> Alarm | None:
        """Every rank's scaled gradients overflowed, every loss is finite: the GradScaler's routine backoff."""
        self.overflow_streak += 1
        if self.overflow_streak <= self.config.max_scaler_overflow_steps:
            result.overflow = True
            return None
        message = (f"gradients non-finite on every rank for {self.overflow_streak} consecutive steps, "
                   f"past the GradScaler's backoff ({self.config.max_scaler_overflow_steps} allowed)")
        return self._alarm(step, Detector.NONFINITE_GRAD, [], False, self._nonfinite_evidence(nonfinite), message)

    def _judge_audit(self, own: _Pass) -> AuditVerdict:
        """A pair disagreed: gather both sides' records (O(world), only now) and judge them."""
        assert own.own_record is not None
        assert own.audit_record is not None
        mine = torch.cat([own.own_record, own.audit_record])
        both = self._all_gather(mine)
        width = both.shape[1] // 2
        return judge_audit(both[:, :width], both[:, width:], self.topology.ranks_per_node,
                           names=layout_order(self.hook.layout))

    def _confirm(self, step: int, claims: torch.Tensor, owners: dict[int, tuple[str, ...]],
                 *, digests: bool) -> _Confirmation:
        """Recompute each owner's micro-batch on its confirmers (this rank does at most two), gather, judge."""
        width = claims.shape[1]
        mine = torch.zeros(2, 1 + width, dtype=torch.int64, device=self.device)
        for slot, owner in self.ring.assignments(self.topology.rank, set(owners)):
            mine[slot, 0] = 1
            mine[slot, 1:] = self._claim_of_recomputation(step, owner, digests=digests)
        records = self._all_gather(mine.reshape(-1)).reshape(-1, 2, 1 + width)
        verdict = confirm.judge_confirmations(claims, records, owners, self.ring)
        return _Confirmation(verdict, claims, records)

    def _claim_of_recomputation(self, step: int, owner: int, *, digests: bool) -> torch.Tensor:
        recomputation = self._recompute(step, owner)
        return confirm.claim_from_recomputation(recomputation, self.hook.layout, self.device,
                                                nonfinite=self.config.nonfinite, norms=self.hook.measure_norms,
                                                digests=digests)

    def _confirm_and_decide(self, step: int, result: StepResult, claims: torch.Tensor,
                            owners: dict[int, list[str]], nonfinite: Any, audit: AuditVerdict | None,
                            names: list[str]) -> Alarm | None:
        """Confirm before blame (the same on every rank): recompute each owner's micro-batch on other nodes and
        decide, or without a confirmation (``confirm`` off, or no other node) take the detectors' own verdicts.

        ``owners`` maps each rank to why it is confirmed; ``names`` label the digests of an audit step's claims
        (parameters under DDP). Returns what :meth:`_decide` returns; None at once without an owner.
        """
        if not owners:
            return None
        result.confirmed = sorted(owners)
        if not (self.config.confirm and self.ring.possible):
            return self._unconfirmed(step, nonfinite, audit)
        confirmation = self._confirm(step, claims, {r: tuple(v) for r, v in owners.items()}, digests=result.audited)
        return self._decide(step, result, confirmation, nonfinite, audit, names)

    def _decide(self, step: int, result: StepResult, c: _Confirmation, nonfinite: Any,
                audit: AuditVerdict | None, names: list[str]) -> Alarm | None:
        """What the confirmations say: an alarm (the suspects' hardware, or a failed audit's auditors'), or None
        with ``result.data_fault`` set (the NaN/Inf reproduced), or None alone (a jump the recomputations
        reproduced). Raises DataFaultLimit past ``max_data_faults``."""
        verdict = c.verdict
        pairs = [RingPair(auditor=a, audited=t, loss_match=m, expected_loss=e, observed_loss=o,
                          mismatched_params=[self._param_label(n) for n in p[:64]])
                 for outcome in verdict.outcomes
                 for a, t, m, e, o, p in confirm.pair_rows(outcome, c.claims, c.records, self.ring,
                                                           names if result.audited else None)][:4096]
        if verdict.mismatched:
            persistence = self._persistence(step, c, digests=result.audited)
            suspects, localized = verdict.suspects, verdict.localized
            reasons = {r for o in verdict.mismatched for r in o.reasons}
            where = "localised by the recomputations on other nodes" if localized else "not localised"
            if confirm.NONFINITE in reasons and nonfinite is not None:
                evidence: Any = self._nonfinite_evidence(nonfinite).model_copy(update={"confirmation": pairs})
                message = (f"non-finite gradients on rank(s) {nonfinite.local_ranks or nonfinite.loss_ranks} that "
                           f"another node's recomputation did not reproduce; suspects {suspects} ({where})")
                return self._alarm(step, Detector.NONFINITE_GRAD, suspects, localized, evidence, message,
                                   persistence)
            disagreed = [p for p in pairs if p.audited in {o.owner for o in verdict.mismatched}
                         and not self._pair_agrees(p, verdict)]
            audit_pairs = self._ring_pairs(audit) if audit is not None and not audit.clean else []
            trigger = "audit" if confirm.AUDIT in reasons else "magnitude"
            evidence = ring_evidence(audit_pairs or disagreed or pairs).model_copy(
                update={"trigger": trigger, "confirmation": pairs})
            what = "failed the ring audit" if trigger == "audit" else "jumped (magnitude trigger)"
            message = (f"rank(s) {sorted(o.owner for o in verdict.mismatched)} {what} and other nodes' "
                       f"recomputations disagree; suspects {suspects} ({where})")
            return self._alarm(step, Detector.RING_AUDIT, suspects, localized, evidence, message, persistence)
        if audit is not None and not audit.clean:
            # Every recomputation now reproduces the audited ranks' claims: the auditor got it wrong once.
            auditors = sorted({p.auditor for p in audit.mismatched})
            evidence = ring_evidence(self._ring_pairs(audit)).model_copy(update={"confirmation": pairs})
            return self._alarm(step, Detector.RING_AUDIT, auditors, self.ring.units >= 3, evidence,
                               f"the audit by rank(s) {auditors} disagreed, but two other recomputations reproduced "
                               f"the audited claims: the auditors' hardware", "transient")
        data_owners = sorted(o.owner for o in verdict.outcomes if confirm.NONFINITE in o.reasons)
        if data_owners:
            return self._data_fault(step, result, data_owners)
        log.info("step %d: the magnitude trigger of rank(s) %s fired; the recomputations reproduced it", step,
                 [o.owner for o in verdict.outcomes])
        return None

    def _pair_agrees(self, pair: RingPair, verdict: confirm.ConfirmationVerdict) -> bool:
        for outcome in verdict.outcomes:
            if outcome.owner == pair.audited and pair.auditor in outcome.confirmers:
                return outcome.agrees[outcome.confirmers.index(pair.auditor)]
        return True

    def _ring_pairs(self, audit: AuditVerdict) -> list[RingPair]:
        return [RingPair(auditor=p.auditor, audited=p.audited, loss_match=p.loss_match,
                         expected_loss=p.expected_loss, observed_loss=p.observed_loss,
                         mismatched_params=[self._param_label(n) for n in p.mismatched_params[:64]])
                for p in audit.mismatched][:4096]

    def _param_label(self, name: str) -> str:
        """How an alarm names a digest that disagreed: under DDP, the parameter's name."""
        return name

    def _nonfinite_evidence(self, nonfinite: Any) -> NonFiniteEvidence:
        """Detector 1's evidence from its reading of the gathered rows (under DDP: per bucket)."""
        return nonfinite_evidence(nonfinite.local_ranks, bool(nonfinite.reduced_ranks), nonfinite.buckets)

    def _nonfinite_named(self, nonfinite: Any) -> list[int]:
        """The ranks an unconfirmed non-finite alarm names: under DDP, those with non-finite local gradients,
        else those with a non-finite loss."""
        return list(nonfinite.local_ranks or nonfinite.loss_ranks)

    def _persistence(self, step: int, c: _Confirmation, *, digests: bool) -> FaultPersistence:
        """Each localised suspect replays once the micro-batch it got wrong (a collective)."""
        plan = confirm.replay_plan(c.verdict)
        if not plan:
            return "unknown"
        width = c.claims.shape[1]
        mine = torch.zeros(1 + width, dtype=torch.int64, device=self.device)
        if self.topology.rank in plan:
            mine[0] = 1
            mine[1:] = self._claim_of_recomputation(step, plan[self.topology.rank].owner, digests=digests)
        replays = self._all_gather(mine)
        return confirm.persistence(replays, plan, c.claims, c.records, self.ring)

    def _data_fault(self, step: int, result: StepResult, ranks: list[int]) -> Alarm | None:
        """The recomputations reproduced the NaN/Inf: skip the update on every rank, warn, count."""
        self.data_fault_streak += 1
        result.data_fault = True
        result.overflow = self.scaler is not None
        log.warning("step %d: non-finite gradients on rank(s) %s, reproduced on other nodes: a data fault, not the "
                    "hardware; the update is skipped on every rank (%d in a row)", step, ranks,
                    self.data_fault_streak)
        if self.data_fault_streak > self.config.max_data_faults:
            self.optimizer.zero_grad(set_to_none=True)
            raise DataFaultLimit(step, ranks, self.data_fault_streak, self.config.max_data_faults)
        return None

    def _unconfirmed(self, step: int, nonfinite: Any, audit: AuditVerdict | None) -> Alarm | None:
        """No other node can recompute (confirmation off, or one rank): the detectors' own verdicts."""
        if nonfinite is not None and (nonfinite.local_ranks or nonfinite.loss_ranks):
            named = self._nonfinite_named(nonfinite)
            suspects = [] if len(nonfinite.local_ranks) == self.topology.world_size else named
            return self._alarm(step, Detector.NONFINITE_GRAD, suspects, bool(suspects),
                               self._nonfinite_evidence(nonfinite), f"non-finite local gradients on rank(s) {named}")
        if audit is not None and not audit.clean:
            where = "disagrees with both ring neighbours" if audit.localized else "involved in a failed audit"
            return self._alarm(step, Detector.RING_AUDIT, audit.suspects, audit.localized,
                               ring_evidence(self._ring_pairs(audit)), f"rank(s) {audit.suspects} {where}")
        return None  # the magnitude trigger alone never raises an alarm

    # -- detector 3 -----------------------------------------------------------------------------------

    def checked_tensors(self) -> list[torch.Tensor]:
        """What the weight fingerprint covers beyond the trainable parameters and the optimizer state:
        the frozen parameters, then the checked buffers (looked up by name: a load may replace them)."""
        params = dict(self.model.module.named_parameters())
        buffers = dict(self.model.module.named_buffers())
        return [params[n] for n in self.frozen_names] + [buffers[n] for n in self.buffer_names]

    def state_fingerprint_hex(self) -> str:
        """This rank's fingerprint of everything detector 3 compares (what a checkpoint manifest records)."""
        return state_fingerprint_hex(self.params, self.optimizer, self.checked_tensors())

    def agreed_fingerprint(self, step: int) -> tuple[str | None, Alarm | None]:
        """Compare the weights, optimizer state and checked buffers of all replicas (a collective: every rank
        calls it). Returns (the fingerprint every replica holds, None) or (None, the alarm).
        """
        lanes = state_fingerprint(self.params, self.optimizer, self.checked_tensors())
        ballot = vote(self._all_gather(lanes.to(self.device)))
        if ballot.unanimous:
            self.last_clean[Detector.WEIGHT_FINGERPRINT.value] = step
            return ballot.groups[0][0], None
        suspects = ballot.dissenters
        alarm = self._alarm(step, Detector.WEIGHT_FINGERPRINT, suspects, ballot.majority is not None,
                            fingerprint_evidence("weight_fingerprint", ballot.groups, ballot.majority,
                                                 "weights+optimizer"),
                            f"replicas hold different weights; outside the strict majority: {suspects}"
                            if ballot.majority else "replicas hold different weights and no strict majority")
        return None, alarm

    def _check_weights(self, step: int) -> Alarm | None:
        return self.agreed_fingerprint(step)[1]

    # -- checkpoints ----------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> CheckpointWriter:
        """The job's checkpoint writer on ``config.checkpoint_prefix`` (made on first use)."""
        if self._checkpoints is None:
            injection, topo = self.injector.injection, self.topology
            corrupt = None
            if injection is not None and injection.kind == "checkpoint_corrupt":
                corrupt = functools.partial(corrupt_checkpoint_bytes, node=topo.node, injection=injection)
            self._checkpoints = CheckpointWriter(
                self.config.checkpoint_prefix, corrupt=corrupt, group=self.group,
                written_by=f"sdcguard agent rank {topo.rank} on {topo.host}"[:256])
        return self._checkpoints

    def save_checkpoint(self, step: int, *, data_position: Any = None,
                        extra: dict[str, Any] | None = None) -> SaveResult | None:
        """Check that all replicas agree, then save the state a resumed job needs to run ``step`` next.

        Every rank calls it at the same ``step`` (the state after the updates
        of steps ``0 .. step-1``); the LR scheduler's and the GradScaler's state
        go with the model and the optimizer (under ``extra[LOOP_STATE]``). The
        weight fingerprint all replicas agreed on goes into the manifest. If they disagree, nothing is saved: the
        alarm is published and the policy applies (None is returned under
        "continue"). A save that fails to store (an S3 outage) is tried
        ``checkpoint_retries`` times in all, waiting ``checkpoint_retry_delay_s``
        (doubling) in between, on every rank alike; then
        ``on_checkpoint_failure`` applies: "continue" logs it and returns None
        (the resume pointer keeps the last good checkpoint), "raise" raises
        ``CheckpointSaveFailed`` on every rank.
        """
        fingerprint, alarm = self.agreed_fingerprint(step)
        if alarm is not None:
            self._handle(alarm, StepResult(step=step, loss=math.nan))
            return None
        assert fingerprint is not None
        cfg = self.config
        failure: CheckpointSaveFailed | None = None
        for attempt in range(1, cfg.checkpoint_retries + 1):
            try:
                return self.checkpoints.save(
                    step, model=self.model, optimizer=self.optimizer, fingerprint=fingerprint,
                    data_position=data_position, extra={**(extra or {}), **self._loop_state()},
                    last_clean_audit_step=self.last_clean[Detector.RING_AUDIT.value],
                    last_clean_fingerprint_step=self.last_clean[Detector.WEIGHT_FINGERPRINT.value],
                )
            except CheckpointSaveFailed as exc:  # raised on every rank together: all retry alike
                failure = exc
                if attempt < cfg.checkpoint_retries:
                    delay = cfg.checkpoint_retry_delay_s * 2 ** (attempt - 1)
                    log.warning("checkpoint at step %d failed (attempt %d of %d): %s; retrying in %.1f s", step,
                                attempt, cfg.checkpoint_retries, exc, delay)
                    time.sleep(delay)
        assert failure is not None
        if cfg.on_checkpoint_failure == "raise":
            raise failure
        log.error("checkpoint at step %d not saved after %d attempts (%s); training goes on, the resume pointer "
                  "keeps the last good checkpoint (on_checkpoint_failure=continue)", step, cfg.checkpoint_retries,
                  failure)
        return None

    def resume_step(self) -> int:
        """Load the checkpoint the resume pointer names (else the newest committed one); the first step to run.

        Returns 0 when there is no checkpoint. Every rank calls it together.
        The LR scheduler's and the GradScaler's state come back with the model
        and the optimizer (a warning when the checkpoint holds none), so the
        resumed run is the one that stopped, learning rate included. The last
        clean audit and fingerprint steps come back from the
        manifest, so an alarm after the restart never claims a trusted step
        later than what was checked. Raises ``lineage.errors.CheckpointCorrupt``
        on every rank when an object fails its sha256 or the loaded state does
        not give the manifest's fingerprint: the job refuses to train from it.
        """
        loaded = self.checkpoints.load(model=self.model, optimizer=self.optimizer,
                                       fingerprint_fn=self.state_fingerprint_hex)
        if loaded is None:
            return 0
        self.resumed = loaded
        self._restore_loop_state(loaded)
        self.last_clean = {d.value: None for d in Detector}
        self.last_clean[Detector.RING_AUDIT.value] = loaded.manifest.last_clean_audit_step
        self.last_clean[Detector.WEIGHT_FINGERPRINT.value] = loaded.manifest.last_clean_fingerprint_step
        log.warning("resumed from %s (step %d, via %s)", loaded.uri, loaded.step, loaded.source)
        return loaded.step

    def _loop_state(self) -> dict[str, Any]:
        """The schedule's and the GradScaler's state, for the checkpoint (under the extra key LOOP_STATE)."""
        state: dict[str, Any] = {}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return {LOOP_STATE: state} if state else {}

    def _restore_loop_state(self, loaded: LoadedCheckpoint) -> None:
        """Put the schedule and the GradScaler back where the checkpoint left them (a warning when it lacks one)."""
        state = loaded.extra.get(LOOP_STATE) or {}
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if obj is None:
                continue
            if name in state:
                obj.load_state_dict(state[name])
            else:
                log.warning("%s holds no %s state: the %s starts afresh, so this run will not be the one that "
                            "saved it", loaded.uri, name, name)

    # -- alarms ---------------------------------------------------------------------------------------

    def _alarm(self, step: int, detector: Detector, suspects: list[int], localized: bool,
               evidence: Any, message: str, persistence: FaultPersistence = "unknown") -> Alarm:
        return build_alarm(
            alarm_id=f"{self.run_id:016x}-{step}-{detector.value}",
            config=self.config,
            topology=self.topology,
            identities=self.identities,
            detector=detector,
            step=step,
            suspects=suspects,
            localized=localized and bool(suspects),
            evidence=evidence,
            last_clean=LastClean(**self.last_clean),
            message=message,
            fault_persistence=persistence,
        )

    def _handle(self, alarm: Alarm, result: StepResult) -> StepResult:
        """Skip the update, publish from one rank, wait for it, then apply the policy."""
        self.optimizer.zero_grad(set_to_none=True)
        result.alarm = alarm
        result.updated = False
        self.alarms.append(alarm)
        log.error("SDC alarm at step %d by %s: suspects %s (%s)", alarm.step, alarm.detector.value,
                  alarm.suspect_ranks, alarm.message)
        if self.topology.rank == alarm.publisher_rank:
            result.published = self.publisher.publish(alarm)
        # The others wait for the publisher: under "stop", torchrun would
        # otherwise kill it when the first rank exits.
        if self.topology.world_size > 1:
            dist.barrier(group=self.group)
        if self.config.on_alarm == "raise":
            raise GuardAlarm(alarm)
        if self.config.on_alarm == "stop":
            log.error("stopping: exit code %d (on_alarm=stop)", ALARM_EXIT_CODE)
            sys.stderr.flush()
            raise SystemExit(ALARM_EXIT_CODE)
        return result

    # -- collectives ----------------------------------------------------------------------------------

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[world, n]`` on the CPU (only on the disagreement path, and for the weight check)."""
        if self.topology.world_size == 1:
            return local.reshape(1, -1).cpu()
        out = [torch.empty_like(local) for _ in range(self.topology.world_size)]
        dist.all_gather(out, local, group=self.group)
        return torch.stack(out).cpu()

    def _agree_run_id(self) -> int:
        """A random id chosen by rank 0, so every rank names an alarm the same way.

        From ``os.urandom``: a job that seeds Python's ``random`` would
        otherwise draw the same id after every restart and reuse alarm ids."""
        mine = torch.tensor([int.from_bytes(os.urandom(8), "little") >> 2], dtype=torch.int64, device=self.device)
        if self.topology.world_size > 1:
            dist.broadcast(mine, src=self._global(0), group=self.group)
        return int(mine.item())


def _settle_buckets(model: torch.nn.parallel.DistributedDataParallel, loss_fn: LossFn, batch: Any) -> set[str]:
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
