"""SDCGuard: one checked training step (forward, backward, detectors, update or skip).

Order inside a step; nothing reaches ``optimizer.step()`` unchecked:

1. On weight-check steps, detector 3 compares the fingerprints of the weights
   and optimizer state every replica holds (the state after the updates of
   steps ``0 .. step-1``); a mismatch skips the whole step.
2. Seed the random state for (step, rank), forward and backward through DDP;
   the communication hook checks local and reduced gradients (detector 1),
   fingerprints the reduced gradients, and on audit steps records
   per-parameter local-gradient fingerprints.
3. On audit steps, recompute the audited rank's micro-batch (detector 2).
4. One all-gather carries every rank's findings; every rank reaches the same
   verdict from the same data.
5. Update, or on an alarm skip the update, publish, and apply the policy.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agent import native, replay
from agent.alarm import (
    RankIdentity,
    build_alarm,
    fingerprint_evidence,
    gather_identities,
    nonfinite_evidence,
    ring_evidence,
)
from agent.checkpoint import CheckpointWriter, LoadedCheckpoint, SaveResult
from agent.config import ALARM_EXIT_CODE, GuardConfig
from agent.inject import Injection, Injector, corrupt_checkpoint_bytes
from agent.inject import from_env as injection_from_env
from agent.nonfinite import REDUCED_FP, SUMMARY_WIDTH, GradientHook, judge_nonfinite, reduced_fingerprints
from agent.publisher import Publisher, PublishOutcome
from agent.ring_audit import (
    Recomputation,
    name_parameters,
    owner_gradients,
    owner_record,
    param_fingerprints,
    recompute,
)
from agent.ring_audit import judge as judge_audit
from agent.topology import Topology
from agent.weights import state_fingerprint, state_fingerprint_hex, vote
from contract import Alarm, Detector, LastClean, RingPair

log = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
BatchFor = Callable[[int, int], Any]


class GuardAlarm(RuntimeError):
    """Raised by ``SDCGuard.step`` under ``on_alarm="raise"``; ``.alarm`` is the published alarm."""

    def __init__(self, alarm: Alarm) -> None:
        super().__init__(f"SDC alarm at step {alarm.step} ({alarm.detector.value}): suspects {alarm.suspect_ranks}")
        self.alarm = alarm


@dataclass
class StepResult:
    """What one guarded step did."""

    step: int
    loss: float
    """This rank's loss (NaN when the step was skipped before the forward)."""
    alarm: Alarm | None = None
    """The alarm raised at this step, or None."""
    updated: bool = False
    """Whether the optimizer applied this step's update."""
    audited: bool = False
    weights_checked: bool = False
    overflow: bool = False
    """A GradScaler overflow: the update was skipped as the scaler would, no alarm."""
    published: PublishOutcome | None = None
    """On the publishing rank, what became of the alarm."""


class SDCGuard:
    """Wraps a DDP model and its optimizer; ``step(step)`` runs one checked training step.

    ``loss_fn(module, batch)`` returns the scalar loss; ``batch_for(step, rank)``
    returns the exact micro-batch ``rank`` trains on at ``step`` (the ring audit
    recomputes other ranks' micro-batches with it). ``scaler`` is an optional
    ``torch.amp.GradScaler``. ``injection`` defaults to ``SDCGUARD_INJECT``.
    Raises ``ValueError`` for a model that is not DDP-wrapped or a bad setting.
    """

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
        injection: Injection | str | None = "env",
        group: dist.ProcessGroup | None = None,
        checkpoints: CheckpointWriter | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("model: must be a torch.nn.parallel.DistributedDataParallel")
        self.config = config if config is not None else GuardConfig.from_env()
        replay.pin_threads(self.config.threads)
        # Build (or load) the fingerprint kernel now, on the main thread: not on a
        # gloo thread in the middle of the first step; a bad setting fails here.
        native.kernel()
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        self.scaler = scaler
        self.group = group
        self.topology = Topology.from_env(ranks_per_node=self.config.ranks_per_node,
                                          rank=dist.get_rank(group), world_size=dist.get_world_size(group))
        self.publisher = publisher if publisher is not None else Publisher(self.config)
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.audit_enabled = self.config.audit_every > 0 and self.topology.nodes >= 2
        if self.config.deterministic and self.audit_enabled:
            replay.use_deterministic_algorithms(self.device)
        _settle_buckets(model, loss_fn, batch_for(0, dist.get_rank(group)))
        if isinstance(injection, str):
            injection = injection_from_env()
        self.injector = Injector(injection, self.topology.rank, self.topology.node)
        if injection is not None and injection.kind in ("nan_activation", "finite_activation"):
            # The last Linear (in a GPT, the head): no dropout after it can
            # mask the corrupted element, as it could deeper inside the model.
            linears = [m for m in model.module.modules() if isinstance(m, torch.nn.Linear)]
            target = linears[-1] if linears else None
            if target is None:
                raise ValueError("injection: an activation fault needs a torch.nn.Linear in the model")
            target.register_forward_hook(self.injector.activation_hook())
        self.hook = GradientHook({id(p): n for n, p in named}, self.topology.world_size, self.injector, group)
        self.hook.check_nonfinite = self.config.nonfinite
        self.hook.check_reduced = self.config.reduced_grad
        self.hook.register(model)
        self.identities: list[RankIdentity] = gather_identities(self.topology, self.device, group)
        self.run_id = self._agree_run_id()
        if self.config.audit_every > 0 and not self.audit_enabled:
            log.warning("ring audit off: it needs ranks on at least 2 nodes (world %d, %d ranks per node)",
                        self.topology.world_size, self.topology.ranks_per_node)
        self.last_clean: dict[str, int | None] = {d.value: None for d in Detector}
        self.overflow_streak = 0
        self.alarms: list[Alarm] = []
        self._checkpoints = checkpoints
        self.resumed: LoadedCheckpoint | None = None

    # -- the step -------------------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        """Run training step ``step`` with every due check; update only if all passed.

        Returns the StepResult. On an alarm the update is skipped and the alarm
        published, then ``on_alarm`` applies: "stop" exits the process with
        ALARM_EXIT_CODE, "raise" raises GuardAlarm, "continue" returns it in
        the result.
        """
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        self.injector.begin_step(step)
        cfg, topo = self.config, self.topology
        result = StepResult(step=step, loss=math.nan)
        if cfg.fingerprint_every and step % cfg.fingerprint_every == 0:
            result.weights_checked = True
            alarm = self._check_weights(step)
            if alarm is not None:
                return self._handle(alarm, result)
        result.audited = self.audit_enabled and step % cfg.audit_every == 0
        self.optimizer.zero_grad(set_to_none=True)
        replay.seed_micro_batch(cfg.seed, step, topo.rank)
        self.hook.begin_step(record_params=result.audited)
        loss = self.loss_fn(self.model, self.batch_for(step, topo.rank))
        self._scaled(loss).backward()
        parts = [self.hook.summary(loss, self.device)]
        recomputation = None
        if result.audited:
            parts.append(owner_record(loss, self.hook, self.device))
            replay.seed_micro_batch(cfg.seed, step, topo.audits)
            recomputation = recompute(self.model.module, self.loss_fn, self.batch_for(step, topo.audits),
                                      self.names, self.params, self.injector, scale=self._scaled)
            parts.append(recomputation.record(self.hook, self.device))
        gathered = self._all_gather(torch.cat(parts))
        result.loss = float(loss.detach())

        alarm = self._judge_step(step, gathered, result, recomputation)
        if alarm is not None:
            return self._handle(alarm, result)
        if result.overflow:
            self._apply_update(overflow=True)
            return result
        if result.audited:
            self.last_clean[Detector.RING_AUDIT.value] = step
        self._apply_update(overflow=False)
        self.injector.weights(self.params)
        result.updated = True
        return result

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _apply_update(self, *, overflow: bool) -> None:
        if self.scaler is not None:
            # On an overflow every rank's gradients are non-finite, so the
            # scaler skips the update and backs off on every rank alike.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not overflow:
            self.optimizer.step()

    def _judge_step(self, step: int, gathered: torch.Tensor, result: StepResult,
                    recomputation: Recomputation | None) -> Alarm | None:
        """Every detector's verdict on the gathered findings; the first that fires makes the alarm."""
        cfg, world = self.config, self.topology.world_size
        summaries = gathered[:, :SUMMARY_WIDTH]
        if cfg.nonfinite:
            verdict = judge_nonfinite(summaries)
            if not verdict.clean:
                everyone = len(verdict.local_ranks) == world
                if self.scaler is not None and everyone and not verdict.loss_ranks:
                    self.overflow_streak += 1
                    if self.overflow_streak <= cfg.max_scaler_overflow_steps:
                        result.overflow = True
                        return None
                    message = (f"gradients non-finite on every rank for {self.overflow_streak} consecutive steps, "
                               f"past the GradScaler's backoff ({cfg.max_scaler_overflow_steps} allowed)")
                    suspects: list[int] = []
                elif verdict.local_ranks:
                    suspects = [] if everyone else verdict.local_ranks
                    message = f"non-finite local gradients on rank(s) {verdict.local_ranks}"
                else:
                    strict = 0 < len(verdict.reduced_ranks) < world
                    suspects = verdict.reduced_ranks if strict else []
                    message = f"the all-reduce delivered non-finite gradients to rank(s) {verdict.reduced_ranks}"
                return self._alarm(step, Detector.NONFINITE_GRAD, suspects, bool(suspects),
                                   nonfinite_evidence(verdict.local_ranks, bool(verdict.reduced_ranks),
                                                      verdict.buckets), message)
            self.overflow_streak = 0
            self.last_clean[Detector.NONFINITE_GRAD.value] = step
        if cfg.reduced_grad:
            lanes = summaries[:, REDUCED_FP]
            ballot = vote(reduced_fingerprints(summaries)) if not bool((lanes == lanes[0]).all()) else None
            if ballot is not None and not ballot.unanimous:
                suspects = ballot.dissenters
                return self._alarm(step, Detector.REDUCED_GRAD, suspects, ballot.majority is not None,
                                   fingerprint_evidence("reduced_grad", ballot.groups, ballot.majority,
                                                        "reduced_gradients"),
                                   f"ranks received different reduced gradients; outside the majority: {suspects}")
            self.last_clean[Detector.REDUCED_GRAD.value] = step
        if result.audited:
            width = (gathered.shape[1] - SUMMARY_WIDTH) // 2
            owners = gathered[:, SUMMARY_WIDTH:SUMMARY_WIDTH + width]
            recomputed = gathered[:, SUMMARY_WIDTH + width:]
            audit = judge_audit(owners, recomputed, self.topology.ranks_per_node)
            if not audit.clean and recomputation is not None:
                # Only after a failure: a second collective names the parameters.
                mine = torch.stack([param_fingerprints(owner_gradients(self.hook), self.names, self.device),
                                    param_fingerprints(recomputation.grads, self.names, self.device)])
                both = self._all_gather(mine.reshape(-1)).reshape(world, 2, len(self.names), 3)
                audit = name_parameters(audit, both[:, 0], both[:, 1], self.names, self.topology.ranks_per_node)
            if not audit.clean:
                pairs = [RingPair(auditor=p.auditor, audited=p.audited, loss_match=p.loss_match,
                                  expected_loss=p.expected_loss, observed_loss=p.observed_loss,
                                  mismatched_params=p.mismatched_params[:64]) for p in audit.mismatched]
                where = "disagrees with both ring neighbours" if audit.localized else "involved in a failed audit"
                return self._alarm(step, Detector.RING_AUDIT, audit.suspects, audit.localized,
                                   ring_evidence(pairs), f"rank(s) {audit.suspects} {where}")
        return None

    # -- detector 3 -----------------------------------------------------------------------------------

    def agreed_fingerprint(self, step: int) -> tuple[str | None, Alarm | None]:
        """Compare the weights and optimizer state of all replicas (a collective: every rank calls it).

        Returns (the fingerprint every replica holds, None) or (None, the alarm).
        """
        lanes = state_fingerprint(self.params, self.optimizer)
        ballot = vote(list(self._all_gather(lanes.to(self.device))))
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
                self.config.checkpoint_prefix, corrupt=corrupt,
                written_by=f"sdcguard agent rank {topo.rank} on {topo.host}"[:256])
        return self._checkpoints

    def save_checkpoint(self, step: int, *, data_position: Any = None,
                        extra: dict[str, Any] | None = None) -> SaveResult | None:
        """Check that all replicas agree, then save the state a resumed job needs to run ``step`` next.

        Every rank calls it at the same ``step`` (the state after the updates
        of steps ``0 .. step-1``). The weight fingerprint all replicas agreed
        on goes into the manifest. If they disagree, nothing is saved: the
        alarm is published and the policy applies (None is returned under
        "continue"). Raises the writer's errors (``CheckpointSaveFailed``).
        """
        fingerprint, alarm = self.agreed_fingerprint(step)
        if alarm is not None:
            self._handle(alarm, StepResult(step=step, loss=math.nan))
            return None
        assert fingerprint is not None
        return self.checkpoints.save(
            step, model=self.model, optimizer=self.optimizer, fingerprint=fingerprint,
            data_position=data_position, extra=extra,
            last_clean_audit_step=self.last_clean[Detector.RING_AUDIT.value],
            last_clean_fingerprint_step=self.last_clean[Detector.WEIGHT_FINGERPRINT.value],
        )

    def resume_step(self) -> int:
        """Load the checkpoint the resume pointer names (else the newest committed one); the first step to run.

        Returns 0 when there is no checkpoint. Every rank calls it together.
        Raises ``lineage.errors.CheckpointCorrupt`` on every rank when an
        object fails its sha256 or the loaded state does not give the
        manifest's fingerprint: the job refuses to train from it.
        """
        loaded = self.checkpoints.load(
            model=self.model, optimizer=self.optimizer,
            fingerprint_fn=lambda: state_fingerprint_hex(self.params, self.optimizer))
        if loaded is None:
            return 0
        self.resumed = loaded
        log.warning("resumed from %s (step %d, via %s)", loaded.uri, loaded.step, loaded.source)
        return loaded.step

    # -- alarms ---------------------------------------------------------------------------------------

    def _alarm(self, step: int, detector: Detector, suspects: list[int], localized: bool,
               evidence: Any, message: str) -> Alarm:
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

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[world, n]`` on the CPU: the one host synchronisation of a step."""
        if self.topology.world_size == 1:
            return local.reshape(1, -1).cpu()
        out = [torch.empty_like(local) for _ in range(self.topology.world_size)]
        dist.all_gather(out, local, group=self.group)
        return torch.stack(out).cpu()

    def _agree_run_id(self) -> int:
        """A random id chosen by rank 0, so every rank names an alarm the same way."""
        mine = torch.tensor([random.getrandbits(62)], dtype=torch.int64, device=self.device)
        if self.topology.world_size > 1:
            dist.broadcast(mine, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return int(mine.item())


def _settle_buckets(model: torch.nn.parallel.DistributedDataParallel, loss_fn: LossFn, batch: Any) -> None:
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
    """
    buffers = [b.detach().clone() for b in model.module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    loss_fn(model, batch).backward()
    for param in model.parameters():
        param.grad = None
    with torch.no_grad():
        for buffer, saved in zip(model.module.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
