"""SDCGuard: one checked training step (forward, backward, detectors, confirmation, update or skip).

One step for every parallelism: what differs between DDP and FSDP2 (HSDP or
pure FSDP) sits behind :class:`sdcguard.agent.parallelism.Parallelism`
(sdcguard.agent.data_parallel, sdcguard.agent.sharded), chosen when the guard is built;
the detectors are components with one interface (sdcguard.agent.detectors: when
each is due, its slots on the wire, what it observes, how it judges the
gathered rows, its blame rule), in a list built from the settings (and the
job's own, ``detectors=``). The guard builds, runs the step, holds the one
agreement and applies the decision; deciding is pure
(sdcguard.agent.decide), alarms are sdcguard.agent.alarms', the loop's
checkpointed state sdcguard.agent.loop_state's.
Order inside a step; nothing reaches ``optimizer.step()`` unchecked:

1. On weight-check steps, detector 3 compares the fingerprints of the weights
   (trainable and frozen), the optimizer state and the buffers DDP keeps equal
   (the state after the updates of steps ``0 .. step-1``) within each vote
   group (every replica under DDP; the replicas of each shard under HSDP); a
   mismatch skips the whole step.
2. Seed the random state for (step, rank), then forward (under autocast when
   ``autocast_dtype`` is set) and backward for each of the K micro-batches
   (each loss divided by K, synchronising only on the last); the gradient
   observer (DDP's communication hook, FSDP2's reduce-scatter) checks the
   local and reduced gradients (detector 1), takes the local-gradient norms,
   fingerprints the reduced gradients and, on audit steps, records digests of
   the local gradients. With ``product_checks`` on, every matrix product of
   this pass (and of no recomputation) is checked by checksums
   (sdcguard.agent.product_checks); its flag joins the step's all-reduce.
3. On audit steps, recompute the audited rank's whole step, all K
   micro-batches (detector 2), and send the record to its owner, who compares.
4. The magnitude trigger compares this rank's loss and gradient norm with its
   own history (restored from the checkpoint on a resume); during a fresh
   job's warm-up, also with the other ranks' (an all-gather on those steps).
5. One small all-reduce (sdcguard.agent.findings, laid out from the detectors'
   slots: flags, and the min and max of each vote group's reduced-gradient
   fingerprint) tells every rank whether all
   agree: O(1) in the world size; its result, the loss, the gradient norm and
   the trigger's flag come back to the host in one copy. Only when something
   disagrees are the ranks' findings gathered (:meth:`SDCGuard._resolve`),
   and a suspicious micro-batch is recomputed on other nodes before anything
   is blamed (sdcguard.agent.confirm): the same data fault on any GPU is the data's;
   a recomputation that differs is the hardware's, and the suspect replays
   once to say whether it persists. ``decide`` turns the verdicts, the
   confirmation and the replays into one Decision, which the guard applies.
6. Update (unscale, clip to ``max_grad_norm``, ``optimizer.step()`` or the
   GradScaler's step, then the LR scheduler's step), or skip it all: on an
   alarm (publish, then the policy), on a data fault (every rank skips, a
   warning names the rank), on a GradScaler overflow.

Every recomputation restores the module's buffers and the random state, so
checking changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sdcguard.agent import confirm, findings, native, replay
from sdcguard.agent.alarm import RankIdentity, gather_identities
from sdcguard.agent.alarms import AlarmPolicy, GuardAlarm
from sdcguard.agent.batches import BatchNotReplayable, check_replayable
from sdcguard.agent.checkpoint import CheckpointSaveFailed, LoadedCheckpoint, SaveResult
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.data_parallel import DataParallel
from sdcguard.agent.decide import (
    AlarmDecision,
    Confirmation,
    Context,
    Decision,
    Verdicts,
    decide,
    replays_needed,
)
from sdcguard.agent.detectors import StepDetector, WeightCheck, global_rank, step_detectors
from sdcguard.agent.determinism import DeterminismUnavailable, gather_signatures, signature_differences
from sdcguard.agent.exit_grace import settle_gloo_at_exit
from sdcguard.agent.findings import Layout, StepFindings
from sdcguard.agent.loop_state import LOOP_STATE, loop_state, restore_loop_state
from sdcguard.agent.parallelism import BatchFor, Checkpoints, Job, LossFn, Parallelism, gather_rows
from sdcguard.agent.product_checks import ProductChecks
from sdcguard.agent.publisher import (
    DEFAULT_PUBLISHER,
    NoPublisher,
    Publisher,
    PublisherDefault,
    PublishOutcome,
)
from sdcguard.agent.recomputations import Recomputations
from sdcguard.agent.ring_audit import loss_bits
from sdcguard.agent.testing.inject import Injection, Injector, corrupt_checkpoint_bytes
from sdcguard.agent.testing.inject import from_env as injection_from_env
from sdcguard.agent.topology import Topology
from sdcguard.agent.trigger import MagnitudeTrigger
from sdcguard.agent.weights import vote_in_groups
from sdcguard.contract import Alarm, Detector

log = logging.getLogger(__name__)

__all__ = ["LOOP_STATE", "BatchFor", "DataFaultLimit", "GuardAlarm", "LossFn", "NonReproducible", "SDCGuard",
           "StepResult"]

class DataFaultLimit(RuntimeError):
    """Raised on every rank after more than ``max_data_faults`` consecutive data faults: the run is broken
    (its data, its learning rate), not the hardware. ``.ranks`` and ``.step`` say where it last happened."""

    def __init__(self, step: int, ranks: list[int], streak: int, limit: int) -> None:
        super().__init__(f"{streak} consecutive steps (the last at step {step}, rank(s) {ranks}) had non-finite "
                         f"gradients that a recomputation on another node reproduced: the data or the training "
                         f"setup is at fault, not the hardware (max_data_faults={limit})")
        self.step = step
        self.ranks = ranks


class NonReproducible(RuntimeError):
    """Raised on every rank under ``on_nonreproducible="stop"`` when a recomputation of a micro-batch could not
    reproduce it and the others disagree among themselves too: the computation is not bit-reproducible (a
    non-deterministic kernel, different software), which says nothing about the hardware; no rank is blamed.
    ``.step`` and ``.ranks`` (the owners of that work) say where."""

    def __init__(self, step: int, ranks: list[int]) -> None:
        super().__init__(f"step {step}: the recomputations of rank(s) {ranks}'s micro-batches all disagree: the "
                         f"computation is not bit-reproducible (a non-deterministic kernel, or different software "
                         f"on different nodes), so no rank is blamed; make it deterministic, or set "
                         f"on_nonreproducible=continue to train on")
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
    nonreproducible: bool = False
    """The recomputations of some micro-batch all disagreed (the computation is not bit-reproducible): no rank
    was blamed, the update was skipped, a warning said so (``on_nonreproducible="continue"``); True on every
    rank."""
    published: PublishOutcome | None = None
    """On the publishing rank, what became of the alarm (with ``publisher=None``: not delivered, not spooled)."""


class SDCGuard:
    """Wraps a DDP (or FSDP2) model and its optimizer; ``step(step)`` runs one checked training step.

    ``loss_fn(module, batch)`` returns the scalar loss of one micro-batch;
    ``batch_for(step, rank)`` returns the exact micro-batch ``rank`` trains on at
    ``step`` (with ``grad_accum_steps`` K > 1, a sequence of K of them); the ring
    audit and confirmations recompute other ranks' steps with it. ``scaler``
    is an optional ``torch.amp.GradScaler`` (a disabled one counts as none);
    ``scheduler`` an optional LR scheduler, stepped once after each applied
    update and never on a skipped step; both are saved in every checkpoint and
    restored by :meth:`resume_step`. ``injection`` defaults to
    ``SDCGUARD_INJECT``. ``unchecked_buffers`` names buffers the weight
    fingerprint must leave out. ``publisher`` defaults to EventBridge (the
    config's bus, else the spool); ``publisher=None`` publishes nothing: an
    alarm is logged and ``on_alarm`` applies, but nothing is sent or spooled,
    and nothing spooled earlier is republished. Raises ``ValueError`` for a model that is not
    DDP-wrapped, a bad setting, or a ``batch_for`` that returns other than K
    micro-batches. With a recompute-based check on (the audit, the
    confirmation), it first compares every rank's environment of bit-exact
    recomputation (``sdcguard.agent.determinism``; ``DeterminismUnavailable`` naming
    what differs under ``on_environment_mismatch="refuse"``, else the checks
    are turned off with a warning) and calls ``batch_for(0, rank)`` twice
    (``sdcguard.agent.batches.BatchNotReplayable`` when the two differ).

    ``detectors`` are the job's own detectors (sdcguard.agent.detectors.StepDetector; see
    docs/adding-a-detector.md), run after the built-in ones on every step; ``ValueError`` for one that
    is not a StepDetector.

    With ``mesh`` (a ``DeviceMesh``), ``model`` is an FSDP2 model
    (``fully_shard(..., mesh=mesh)``) and the step runs through
    :class:`sdcguard.agent.sharded.ShardedDataParallel` (see there for what it raises).
    """

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn,
        batch_for: BatchFor,
        config: GuardConfig | None = None,
        publisher: Publisher | PublisherDefault | None = DEFAULT_PUBLISHER,
        scaler: torch.amp.GradScaler | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        injection: Injection | str | None = "env",
        group: dist.ProcessGroup | None = None,
        checkpoints: Checkpoints | None = None,
        unchecked_buffers: tuple[str, ...] = (),
        mesh: Any = None,
        detectors: Sequence[StepDetector[Any]] = (),
    ) -> None:
        cfg = config if config is not None else GuardConfig.from_env()
        for own in detectors:
            if not isinstance(own, StepDetector):
                raise ValueError(f"detectors: {own!r} is not a sdcguard.agent.detectors.StepDetector")
        # A disabled GradScaler (GradScaler(enabled=False), the usual "fp16 only" switch) scales nothing.
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.topology = Topology.from_env(ranks_per_node=cfg.ranks_per_node, rank=dist.get_rank(group),
                                          world_size=dist.get_world_size(group))
        job = Job(config=cfg, loss_fn=loss_fn, batch_for=batch_for, topology=self.topology, scaler=self.scaler)
        self.parallel: Parallelism
        if mesh is not None:
            from sdcguard.agent.sharded import ShardedDataParallel  # FSDP2 and DCP: imported only for a mesh

            self.parallel = ShardedDataParallel(model, optimizer, job, mesh=mesh, group=group)
        else:
            self.parallel = DataParallel(model, optimizer, job, group=group, unchecked_buffers=unchecked_buffers)
        self.config = cfg = self.parallel.job.config
        replay.pin_threads(cfg.threads, self.parallel.device)
        # Build (or load) the fingerprint kernel now, on the main thread: not on a
        # gloo thread in the middle of the first step; a bad setting fails here.
        native.kernel()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.group = group
        if dist.is_initialized():
            settle_gloo_at_exit(group)
        self.ring = self.parallel.ring
        self.recomputations = Recomputations(self.parallel, self.ring, self.topology.rank, self._all_gather)
        """The disagreement path's recomputations on other nodes (sdcguard.agent.recomputations)."""
        # None publishes nothing (no bus, no spool); the default builds the EventBridge publisher.
        if isinstance(publisher, PublisherDefault):
            publisher = Publisher(cfg)
        self.publisher: Publisher = publisher if publisher is not None else NoPublisher(cfg)
        self.params = self.parallel.params
        self.device = self.parallel.device
        self.config = cfg = self._preflight(cfg, group)
        self.audit_enabled = cfg.audit_every > 0 and self.parallel.audit_possible
        recomputes = self.audit_enabled or (cfg.confirm and self.ring.possible)
        if cfg.deterministic and recomputes:
            replay.use_deterministic_algorithms(self.device)
        if recomputes:
            # Before anything trains: a loader that cannot replay would make every recomputation disagree.
            check_replayable(batch_for, 0, self.topology.rank, cfg.grad_accum_steps, self.device)
        self.parallel.install()
        self._step_hooks: list[Callable[[int], None]] = []
        self._stepped = False
        optimizer.register_step_post_hook(self._on_optimizer_step)
        self.trigger = (MagnitudeTrigger(cfg.trigger_ratio, cfg.trigger_window, cfg.trigger_warmup, self.device)
                        if cfg.trigger_ratio > 0 else None)
        # Built after the settling pass (which it must not watch), around the bare module (under FSDP2 the
        # fully_shard model itself): forward hooks that name the sites, nothing else.
        bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.products = ProductChecks(bare, device=self.device) if cfg.product_checks else None
        self.detectors: list[StepDetector[Any]] = [*step_detectors(
            cfg, self.parallel, audit=self.audit_enabled, gather=self._all_gather, group=group, trigger=self.trigger,
            products=self.products, unscaled=self._unscaled, scaled=self.scaler is not None), *detectors]
        """The step's detectors, in the order they observe and judge (sdcguard.agent.detectors)."""
        self.layout = Layout(self.detectors)
        """The step's wire, laid out from the detectors' slots (sdcguard.agent.findings)."""
        self.weight_check = WeightCheck(cfg.fingerprint_every) if cfg.fingerprint_every > 0 else None
        if isinstance(injection, str):
            injection = injection_from_env()
        self.injector = Injector(injection, self.topology.rank, self.topology.node)
        self.injector.install(self.parallel.injection_site(optimizer, self.register_step_hook))
        self.identities: list[RankIdentity] = gather_identities(self.topology, self.device, group)
        self.run_id = self._agree_run_id()
        self.alarm_policy = AlarmPolicy(self.parallel, topology=self.topology, identities=self.identities,
                                        run_id=self.run_id, publisher=self.publisher, optimizer=optimizer,
                                        scaler=self.scaler, group=group)
        """Building, publishing and the policy of this guard's alarms (sdcguard.agent.alarms)."""
        if cfg.audit_every > 0 and not self.audit_enabled:
            log.warning("ring audit off: it needs %s (world %d, %d ranks per node)", self.parallel.audit_needs,
                        self.topology.world_size, self.topology.ranks_per_node)
        self.last_clean: dict[str, int | None] = {d.value: None for d in Detector}
        self.overflow_streak = 0
        self.data_fault_streak = 0
        self.nonreproducible_steps = 0
        """Steps whose recomputations showed the computation is not bit-reproducible (no rank blamed)."""
        self.alarms: list[Alarm] = self.alarm_policy.raised
        """Every alarm raised so far, in order."""
        self._checkpoints = checkpoints
        self.resumed: LoadedCheckpoint | None = None
        """The checkpoint :meth:`resume_step` loaded (None before, or when there was none)."""
        self.republished: dict[str, PublishOutcome] = {}
        """What became of the alarms an earlier start had spooled (republished by rank 0 when built)."""
        if self.topology.rank == 0:
            self.republished = self.publisher.republish_spooled()

    def _preflight(self, cfg: GuardConfig, group: dist.ProcessGroup | None) -> GuardConfig:
        """Compare every rank's environment of bit-exact recomputation (a collective) when a recompute-based
        check is on; where ranks differ, refuse to start (DeterminismUnavailable naming what differs) or, under
        ``on_environment_mismatch="degrade"``, return the settings without those checks (a warning)."""
        if not ((cfg.audit_every > 0 and self.parallel.audit_possible) or (cfg.confirm and self.ring.possible)):
            return cfg
        differences = signature_differences(gather_signatures(self.device, group))
        if not differences:
            return cfg
        what = "; ".join(differences)
        if cfg.on_environment_mismatch == "refuse":
            raise DeterminismUnavailable(
                f"the ranks differ in what bit-exact recomputation depends on ({what}): the ring audit and the "
                f"confirmation would blame healthy hardware; run every rank on the same hardware and software, or "
                f"set on_environment_mismatch=degrade to train without those checks")
        log.warning("the ranks differ in what bit-exact recomputation depends on (%s): the ring audit and the "
                    "confirmation are off (on_environment_mismatch=degrade)", what)
        degraded = dataclasses.replace(cfg, audit_every=0, confirm=False)
        self.parallel.job.config = degraded
        return degraded

    @property
    def batch_for(self) -> BatchFor:
        """``batch_for(step, rank)``: the micro-batch(es) ``rank`` trains on at ``step``; replaceable."""
        return self.parallel.job.batch_for

    @batch_for.setter
    def batch_for(self, batch_for: BatchFor) -> None:
        self.parallel.job.batch_for = batch_for

    @property
    def loss_fn(self) -> LossFn:
        """``loss_fn(module, batch)``: the scalar loss of one micro-batch."""
        return self.parallel.job.loss_fn

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
        consecutive data faults, ``sdcguard.agent.batches.BatchNotReplayable`` when a
        recomputation rebuilt other micro-batches than the owner trained on
        (the loader's error, no alarm), and NonReproducible when the
        recomputations of a micro-batch all disagree under
        ``on_nonreproducible="stop"`` (no rank blamed, no alarm).
        """
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        for hook in self._step_hooks:
            hook(step)
        result = StepResult(step=step, loss=math.nan)
        if self.weight_check is not None and self.weight_check.due(step):
            result.weights_checked = True
            alarm = self.agreed_fingerprint(step)[1]
            if alarm is not None:
                return self._handle(alarm, result)
        due = [d for d in self.detectors if d.due(step)]
        result.audited = any(d.detector is Detector.RING_AUDIT for d in due)
        found = self._own_pass(step, due, audited=result.audited)
        for detector in due:
            detector.observe(step, found)
        if self._agree(found, result):
            return self._update(step, result)
        alarm = self._resolve(step, found, result)
        if alarm is not None:
            return self._handle(alarm, result)
        if result.nonreproducible:
            # Finite gradients of doubtful bits: not even a GradScaler may step on them.
            self.optimizer.zero_grad(set_to_none=True)
            return result
        if result.data_fault or result.overflow:
            self._apply_update(overflow=True)
            return result
        return self._update(step, result)

    def _own_pass(self, step: int, due: list[StepDetector[Any]], *, audited: bool) -> StepFindings:
        """The rank's own forward and backward, watched by the due detectors that watch a pass (the product
        checks). Only the own pass is watched: recomputations (audit, confirmation, replay) and the update run
        outside, so a flag is always this rank's own."""
        with contextlib.ExitStack() as watching:
            for detector in due:
                watching.enter_context(detector.watching())
            return self.parallel.forward_backward(step, audited=audited)

    def _unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        """A norm of scaled gradients divided by the GradScaler's scale (unchanged without one)."""
        if self.scaler is None:
            return norm
        # The scale tensor itself (not get_scale(), which would synchronise with the host).
        scale = getattr(self.scaler, "_scale", None)
        return norm / (scale.to(norm) if isinstance(scale, torch.Tensor) else self.scaler.get_scale())

    def _agree(self, found: StepFindings, result: StepResult) -> bool:
        """The step's one collective while all is well: does every rank agree? (the same answer on every rank).

        The answer, this rank's loss, the reduced-gradient norm and the trigger's flag come back to the host
        in one copy, into ``result``."""
        parallel = self.parallel
        vector = self.layout.agreement(found)
        if self.topology.world_size > 1:
            dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group)
        measured = parallel.reduced_norm()
        norm = (self._unscaled(measured) if measured is not None
                else torch.full((), math.nan, dtype=torch.float64, device=self.device))
        trigger = found.trigger if found.trigger is not None else torch.zeros((), dtype=torch.bool, device=self.device)
        figures = torch.stack([loss_bits(found.loss), loss_bits(norm), trigger.to(torch.int64)])
        # The clean step's one wait on the host: everything it reports, in one copy.
        host = torch.cat([vector, figures.to(vector.device)]).tolist()
        result.loss = findings.float_of_bits(host[-3])
        if measured is not None:
            result.grad_norm = findings.float_of_bits(host[-2])
        result.triggered = bool(host[-1])
        return self.layout.agreed(host[:-3])

    def _update(self, step: int, result: StepResult) -> StepResult:
        """Every check passed (or a trigger was confirmed as real): record the clean steps and update."""
        if self.config.nonfinite:
            self.overflow_streak = 0
            self.data_fault_streak = 0
        for detector in self.detectors:
            if detector.due(step):
                self.last_clean[detector.detector.value] = step
                detector.passed(step)
        result.updated = self._apply_update(overflow=False, result=result)
        if result.updated and self.scheduler is not None:
            self.scheduler.step()
        return result

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

    def _resolve(self, step: int, found: StepFindings, result: StepResult) -> Alarm | None:
        """Something disagreed: gather every rank's findings, judge, confirm before blaming, decide (pure,
        sdcguard.agent.decide) and apply the decision (the same on every rank).

        Returns the alarm, or None with ``result.overflow`` / ``result.data_fault`` / ``result.nonreproducible``
        set when the update must be skipped without one, or None alone when the step may update (a magnitude
        jump that the recomputation reproduced).
        """
        claim = self.parallel.own_claim(found, digests=found.own_record is not None)
        rows = self.layout.unpack(self._all_gather(self.layout.row(found, claim)))
        judged: list[tuple[StepDetector[Any], Any]] = []
        for detector in self.detectors:
            verdict = detector.judge(rows, found)
            judged.append((detector, verdict))
            if verdict is not None and detector.final(verdict):
                break  # decided at once: no later detector's collective runs on this step
        verdicts = Verdicts(judged)
        owners = verdicts.owners()
        confirmation: Confirmation | None = None
        replays: confirm.ReplayVerdict | None = None
        names: list[str] | None = None
        if verdicts.final() is None and owners and self.config.confirm and self.ring.possible:
            confirmation = self.recomputations.confirm(step, rows.claims, owners, digests=result.audited)
            names = self.parallel.digest_names() if result.audited else None
            if replays_needed(confirmation):
                replays = self.recomputations.replays(step, confirmation, digests=result.audited)
        context = Context(step=step, world_size=self.topology.world_size, ring=self.ring,
                          max_scaler_overflow_steps=self.config.max_scaler_overflow_steps,
                          overflow_streak=self.overflow_streak, param_label=self.parallel.param_label,
                          digest_names=names)
        return self._apply(step, decide(verdicts, confirmation, replays, context=context), result)

    def _apply(self, step: int, decision: Decision, result: StepResult) -> Alarm | None:
        """Do what ``decision`` says: the alarm built (the caller publishes it), or the skip recorded in
        ``result``. Raises BatchNotReplayable, DataFaultLimit and NonReproducible where the decision is one."""
        result.confirmed = decision.confirmed
        for level, note in decision.notes:
            log.log(level, "%s", note)
        if decision.scaler_overflow:
            self.overflow_streak += 1
        if decision.kind == "alarm":
            assert decision.alarm is not None
            return self._alarm(step, decision.alarm)
        if decision.kind == "overflow":
            result.overflow = True
        elif decision.kind == "unreplayable":
            owner, confirmer = decision.ranks
            self.optimizer.zero_grad(set_to_none=True)
            raise BatchNotReplayable(step, owner, f"rank {confirmer} rebuilt micro-batches whose digest differs "
                                                  f"from those rank {owner} trained on")
        elif decision.kind == "nonreproducible":
            return self._nonreproducible(step, result, decision.ranks)
        elif decision.kind == "data_fault":
            return self._data_fault(step, result, decision.ranks)
        return None

    def _nonreproducible(self, step: int, result: StepResult, ranks: list[int]) -> Alarm | None:
        """The computation of ``ranks``' micro-batches is not bit-reproducible: no alarm, no rank blamed; the
        update is skipped, a warning says so, and ``on_nonreproducible`` says whether to go on (raises
        NonReproducible under "stop")."""
        self.nonreproducible_steps += 1
        result.nonreproducible = True
        log.warning("step %d: the recomputations of rank(s) %s's micro-batches all disagree: the computation is not "
                    "bit-reproducible, no rank is blamed; the update is skipped (%d such step(s) so far)", step,
                    ranks, self.nonreproducible_steps)
        if self.config.on_nonreproducible == "stop":
            self.optimizer.zero_grad(set_to_none=True)
            raise NonReproducible(step, ranks)
        return None

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

    # -- detector 3 -----------------------------------------------------------------------------------

    def state_fingerprint_hex(self) -> str:
        """The fingerprint of everything detector 3 compares, as a checkpoint manifest records it (under a
        mesh a collective: one digest of every shard the replicas agree on)."""
        return self.parallel.state_fingerprint_hex()

    def local_fingerprint_hex(self) -> str:
        """This rank's own fingerprint of what detector 3 compares (under a mesh: of its shards)."""
        return self.parallel.local_fingerprint_hex()

    def agreed_fingerprint(self, step: int) -> tuple[str | None, Alarm | None]:
        """Compare the weights, optimizer state and checked buffers within every vote group (every replica;
        under a mesh the replicas of each shard). A collective: every rank calls it.

        Returns (the one fingerprint every group agrees on, None) or (None, the alarm). Without replicas there
        is nothing to compare: the digest of the state as it is.
        """
        parallel = self.parallel
        verdict = vote_in_groups(self._all_gather(parallel.state_lanes()), parallel.vote_groups)
        if verdict.unanimous:
            if parallel.replicated:
                self.last_clean[Detector.WEIGHT_FINGERPRINT.value] = step
            return parallel.agreed_digest(verdict), None
        return None, self._alarm(step, WeightCheck.alarm(verdict))

    # -- checkpoints ----------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> Checkpoints:
        """The job's checkpoint writer on ``config.checkpoint_prefix`` (made on first use; under a mesh DCP's)."""
        if self._checkpoints is None:
            injection, topo = self.injector.injection, self.topology
            corrupt = None
            if injection is not None and injection.kind == "checkpoint_corrupt":
                corrupt = functools.partial(corrupt_checkpoint_bytes, node=topo.node, injection=injection)
            self._checkpoints = self.parallel.checkpoint_writer(
                self.config.checkpoint_prefix, corrupt=corrupt,
                written_by=f"sdcguard agent rank {topo.rank} on {topo.host}"[:256])
        return self._checkpoints

    def save_checkpoint(self, step: int, *, data_position: Any = None,
                        extra: dict[str, Any] | None = None) -> SaveResult | None:
        """Check that all replicas agree, then save the state a resumed job needs to run ``step`` next.

        Every rank calls it at the same ``step`` (the state after the updates
        of steps ``0 .. step-1``); ``extra`` (the job's own state: a data
        loader's position, counters) comes back as :attr:`resumed_extra` after
        :meth:`resume_step`. The LR scheduler's and the GradScaler's state, and
        every rank's magnitude-trigger history (gathered: a collective), go
        with the model and the optimizer (under ``extra[LOOP_STATE]``). The
        weight fingerprint all replicas agreed on goes into the manifest. If they disagree, nothing is saved: the
        alarm is published and the policy applies (None is returned under
        "continue"). A save that fails to store (an S3 outage) is tried
        ``checkpoint_retries`` times in all, waiting ``checkpoint_retry_delay_s``
        (doubling) in between, on every rank alike; then
        ``on_checkpoint_failure`` applies: "continue" logs it and returns None
        (the resume pointer keeps the last good checkpoint), "raise" raises
        ``CheckpointSaveFailed`` on every rank. A state that cannot be built
        (a ``state_dict()`` that raises) is never retried: the failing rank
        raises its own exception, every other rank ``CheckpointStateError``.
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
                    data_position=data_position,
                    extra={**(extra or {}), **loop_state(scheduler=self.scheduler, scaler=self.scaler,
                                                         trigger=self.trigger, gather=self._all_gather)},
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
        The job's own ``extra`` dict, as given to :meth:`save_checkpoint`, is
        then :attr:`resumed_extra` (``{}`` when nothing was loaded), and the
        loaded checkpoint itself :attr:`resumed` (its ``data_position``, its
        manifest). The trigger's history comes back to each rank, so it watches
        from the first resumed step. The LR scheduler's and the GradScaler's state come back with
        the model and the optimizer (a warning when the checkpoint holds none),
        so the resumed run is the one that stopped, learning rate included. The
        last clean audit and fingerprint steps come back from the manifest, so
        an alarm after the restart never claims a trusted step later than what
        was checked. Raises ``sdcguard.lineage.errors.CheckpointCorrupt`` on every rank
        when an object fails its sha256 or the loaded state does not give the
        manifest's fingerprint: the job refuses to train from it.
        """
        loaded = self.checkpoints.load(model=self.model, optimizer=self.optimizer,
                                       fingerprint_fn=self.state_fingerprint_hex)
        if loaded is None:
            return 0
        self.resumed = loaded
        restore_loop_state(loaded, scheduler=self.scheduler, scaler=self.scaler, trigger=self.trigger,
                           rank=self.topology.rank)
        self.last_clean = {d.value: None for d in Detector}
        self.last_clean[Detector.RING_AUDIT.value] = loaded.manifest.last_clean_audit_step
        self.last_clean[Detector.WEIGHT_FINGERPRINT.value] = loaded.manifest.last_clean_fingerprint_step
        log.warning("resumed from %s (step %d, via %s)", loaded.uri, loaded.step, loaded.source)
        return loaded.step

    @property
    def resumed_extra(self) -> dict[str, Any]:
        """The job's own ``extra`` dict saved with the checkpoint :meth:`resume_step` loaded (without the
        guard's own ``LOOP_STATE`` entry); ``{}`` before a resume or when there was no checkpoint."""
        if self.resumed is None:
            return {}
        return {k: v for k, v in self.resumed.extra.items() if k != LOOP_STATE}

    # -- alarms ---------------------------------------------------------------------------------------

    def _alarm(self, step: int, said: AlarmDecision) -> Alarm:
        """The contract's Alarm of what a detector said (sdcguard.agent.alarms)."""
        return self.alarm_policy.build(step, said, self.last_clean)

    def _handle(self, alarm: Alarm, result: StepResult) -> StepResult:
        """Skip the update, write the capsules, publish, apply the policy (sdcguard.agent.alarms.AlarmPolicy)."""
        result.updated = False
        result.alarm, result.published = self.alarm_policy.handle(alarm)
        return result

    # -- collectives ----------------------------------------------------------------------------------

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[world, n]`` on the CPU (only on the disagreement path, and for the weight check)."""
        return gather_rows(local.to(self.device), self.topology.world_size, self.group)

    def _agree_run_id(self) -> int:
        """A random id chosen by rank 0, so every rank names an alarm the same way.

        From ``os.urandom``: a job that seeds Python's ``random`` would
        otherwise draw the same id after every restart and reuse alarm ids."""
        drawn = torch.tensor([int.from_bytes(os.urandom(8), "little") >> 2], dtype=torch.int64, device=self.device)
        if self.topology.world_size > 1:
            dist.broadcast(drawn, src=global_rank(self.group, 0), group=self.group)
        return int(drawn.item())
