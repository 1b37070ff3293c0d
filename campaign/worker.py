"""What every rank of the campaign runs: one process per simulated node, many faults per process lifetime.

Starting processes and process groups dominates on a small machine, so the
ranks start once and then, in lockstep, (1) train the clean reference run,
keeping the state at the start of every step; (2) run every detector
configuration on the clean run (no alarm allowed, final state bit-identical
to the reference), keeping the magnitude trigger's history at every step, and
check that a run restarted from a snapshot reproduces the clean run; (3) the
clean soak; (4) for every fault, run the faulted training with no detector
(the outcome: benign or silent, and its size; the series the baselines read),
then once per detector configuration (until its first alarm, or the last step
at which it could raise one). Every faulted run starts from the reference's
state, and the trigger's history, a few steps before its fault, since
training before the fault is the clean run.

Several process groups ("worlds", ``launch(worlds=N)``) may share the work:
each trains its own reference, the first runs the clean checks, the last the
soak, and all take the faults in plan order, each claiming the next one not
yet claimed (a file per fault). On a machine with fewer cores than ranks, one
group computes while another waits in a collective.

Rank 0 of each world appends one JSON line per finished unit to
``runs.<world>.jsonl``; the parent merges and judges them (``outcome.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from agent.checkpoint import MODEL, OPTIMIZER, TRAINER, CheckpointWriter, rng_name
from agent.config import GuardConfig
from agent.guard import SDCGuard, StepResult
from agent.publisher import Publisher, PublishOutcome
from agent.train import WORLD_INDEX_ENV, shutdown
from campaign import detectors
from campaign.faults import FaultSpec
from campaign.injectors import ModelShape, ProductMode, checkpoint_corrupter, install
from campaign.job import CampaignJob, JobProblem, built, measured_problems, resolve
from contract import Alarm, LastClean
from contract.checkpoint import checkpoint_dir
from lineage.errors import CheckpointCorrupt, NoSafeCheckpoint
from lineage.selection import select_checkpoint
from lineage.store import LocalStore

log = logging.getLogger(__name__)


class _Quiet(Publisher):
    """Publishes nothing: the campaign reads alarms from the step results."""

    def publish(self, alarm: Alarm) -> PublishOutcome:
        return PublishOutcome()


class _Data:
    """The job's micro-batches on the rank's device, cached (every run of the campaign trains on the same ones)."""

    def __init__(self, job: CampaignJob, device: torch.device) -> None:
        self.source = job.batch_for
        self.device = device
        self.cache: dict[tuple[int, int], Any] = {}

    def __call__(self, step: int, rank: int) -> Any:
        key = (step, rank)
        if key not in self.cache:
            if len(self.cache) > 8192:
                self.cache.clear()
            self.cache[key] = tree_map_only(torch.Tensor, lambda t: t.to(self.device), self.source(step, rank))
        return self.cache[key]


class _Probe:
    """Records what a run's own monitoring would see: the loss (from the step) and the local gradient norm.

    Tensor hooks on the parameters see each local gradient before DDP
    reduces it; only the first pass of a step counts (not an audit's
    recomputation). Install it after a fault's hooks, so it sees their work.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.passes = -1
        self.squares: list[torch.Tensor] = []
        self.handles = [module.register_forward_pre_hook(lambda *_: setattr(self, "passes", self.passes + 1))]
        for p in module.parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._grad))

    def _grad(self, grad: torch.Tensor) -> None:
        if self.passes == 0:
            self.squares.append(grad.detach().double().pow(2).sum())

    def begin_step(self) -> None:
        self.passes = -1
        self.squares = []

    def norm(self) -> float:
        return float(torch.stack(self.squares).sum().sqrt()) if self.squares else math.nan

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _ReducedWatch:
    """What the run without detectors shows of the reduced gradients: were they finite on this rank at every
    step, and a digest of their bits over all steps (equal digests on every rank: every rank received the same
    reduced gradients at every step). Read where the optimizer takes them, in its step pre-hook."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.finite = True
        self.chain = hashlib.sha256()
        self.handle = optimizer.register_step_pre_hook(lambda *_: self._read())

    def _read(self) -> None:
        grads = [p.grad.detach().reshape(-1) for p in self.params if p.grad is not None]
        flat = torch.cat(grads) if grads else torch.zeros(0)
        self.finite = self.finite and bool(torch.isfinite(flat).all())
        self.chain.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())

    def words(self) -> list[float]:
        """The digest as eight 32-bit words (exact in the float64 rows the ranks gather)."""
        digest = self.chain.digest()
        return [float(int.from_bytes(digest[i:i + 4], "little")) for i in range(0, 32, 4)]

    def remove(self) -> None:
        self.handle.remove()


def _flat_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(all weights, all weights, buffers and optimizer state) as flat fp32 copies, in a fixed order."""
    params = [p.detach().reshape(-1) for p in module.parameters()]
    state: list[torch.Tensor] = [b.detach().reshape(-1).float() for b in module.buffers()]
    for p in module.parameters():
        for key in sorted(optimizer.state.get(p, {})):
            value = optimizer.state[p][key]
            if isinstance(value, torch.Tensor):
                state.append(value.detach().reshape(-1).float())
    weights = torch.cat(params)
    return weights.clone(), torch.cat([weights, *state])


@dataclasses.dataclass
class _Snapshot:
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    optimizer: dict[str, Any]

    @classmethod
    def of(cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> _Snapshot:
        return cls([p.detach().clone() for p in module.parameters()],
                   [b.detach().clone() for b in module.buffers()], copy.deepcopy(optimizer.state_dict()))

    def restore(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for t, saved in zip([*module.parameters(), *module.buffers()], [*self.params, *self.buffers],
                                strict=True):
                t.copy_(saved)
        # load_state_dict keeps same-device tensors as they are: hand it copies.
        optimizer.load_state_dict(copy.deepcopy(self.optimizer))


class Rank:
    """One rank's side of the campaign (every method is collective: all ranks call it in the same order)."""

    def __init__(self, plan: dict[str, Any], out: Path, index: int = 0) -> None:
        self.plan = plan
        self.settings = plan["settings"]
        self.out = out
        self.index = index
        """Which of the plan's worlds (process groups) this rank belongs to."""
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.spec: str = self.settings["job"]
        self.job = resolve(self.spec, self.settings["job_seed"])
        self.device = device_for(self.settings["device"], index * self.world)
        self.data = _Data(self.job, self.device)
        self.configs: dict[str, dict[str, Any]] = plan["configs"]
        self.snapshots: dict[int, _Snapshot] = {}
        self.trigger_states: dict[str, dict[int, tuple[torch.Tensor, int]]] = {}
        """Per configuration with the magnitude trigger: its history at the start of every clean step."""
        self.clean_state: dict[int, torch.Tensor] = {}
        self.clean_weights: dict[int, torch.Tensor] = {}
        self.shape: ModelShape | None = None
        self.scratch = out / f"scratch.{index}"

    # -- building one run -----------------------------------------------------------------------------

    def config(self, name: str) -> GuardConfig:
        return GuardConfig(on_alarm="continue", ranks_per_node=1, seed=self.settings["job_seed"],
                           spool_dir=str(self.scratch / "spool"), checkpoint_prefix=str(self.scratch / "unused"),
                           **self.configs[name])

    def guard(self, name: str, start: int | None, checkpoints: CheckpointWriter | None = None,
              ) -> tuple[SDCGuard, torch.nn.Module, torch.optim.Optimizer]:
        """A model at the reference's state at ``start`` (None: as built, for the reference itself), in DDP,
        under a guard configured as ``name``. Raises JobProblem when the job builds something unusable."""
        model, optimizer = built(self.spec, self.job.build(self.device), self.device)
        # DDP hands rank 0's weights to the others here; the snapshot then sets every rank's alike, so a
        # build that differs from call to call (an unseeded init) changes nothing.
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if start is not None:
            self.snapshots[start].restore(model, optimizer)
        config = self.config(name)
        guard = SDCGuard(ddp, optimizer, loss_fn=self.job.loss_fn, batch_for=self.data, config=config,
                         publisher=_Quiet(config), checkpoints=checkpoints)
        if guard.trigger is not None and start:
            # The trigger watches with the history the clean run gave it up to here (a job that trained from
            # step 0 would have it), not from an empty one.
            guard.trigger.load_state(self.trigger_states[name][start])
        return guard, model, optimizer

    def _write(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with (self.out / f"runs.{self.index}.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    def _say(self, line: str) -> None:
        """A progress line on the launcher's standard error (rank 0 of each world)."""
        if self.rank == 0:
            print(f"coverage [group {self.index}]: {line}", file=sys.stderr, flush=True)

    def _gather(self, values: list[float]) -> list[list[float]]:
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(out, local)
        return [t.cpu().tolist() for t in out]

    def _all(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    # -- (1) the clean reference ----------------------------------------------------------------------

    def reference(self) -> None:
        """Train the clean run from step 0, keeping the state at the start of every step and the series.

        Raises JobProblem (on every rank alike) when the model lacks what the planned fault models corrupt."""
        end = self.settings["last_step"]
        guard, module, optimizer = self.guard("none", None)
        probe = _Probe(module)
        counts = {"fwd": 0, "bwd": 0}
        allreduces = [0]
        losses, norms = [], []
        started = time.perf_counter()
        for step in range(end + 1):
            self.snapshots[step] = _Snapshot.of(module, optimizer)
            self.clean_weights[step], self.clean_state[step] = _flat_state(module, optimizer)
            if step == end:
                break
            probe.begin_step()
            if step == 1:
                result = self._measured_step(guard, step, counts, allreduces)
            else:
                result = guard.step(step)
            losses.append(result.loss)
            norms.append(probe.norm())
        probe.remove()
        self.shape = ModelShape(
            products=dict(counts), allreduces=allreduces[0],
            linears=[n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)],
            params=[(n, p.numel()) for n, p in module.named_parameters() if p.requires_grad])
        seconds = time.perf_counter() - started
        del guard
        problems = measured_problems(self.spec, {f["model"] for f in self.plan["faults"]}, self.shape.products,
                                     self.shape.linears, {p.dtype for p in module.parameters() if p.requires_grad})
        if problems:
            raise JobProblem("; ".join(problems))
        series = self._gather(losses + norms)
        model = type(module)
        self._write({"kind": "reference", "steps": end, "seconds": seconds,
                     "shape": dataclasses.asdict(self.shape), "model": f"{model.__module__}.{model.__qualname__}",
                     "trainable": sum(n for _, n in self.shape.params),
                     "losses": [[series[r][s] for r in range(self.world)] for s in range(end)],
                     "norms": [[series[r][end + s] for r in range(self.world)] for s in range(end)]})

    def _measured_step(self, guard: SDCGuard, step: int, counts: dict[str, int], allreduces: list[int]) -> StepResult:
        """One clean step that also counts the matrix products per direction and the float all-reduces."""
        original = dist.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.is_floating_point():
                allreduces[0] += 1
            return original(tensor, *args, **kwargs)

        def count(_out: torch.Tensor, direction: str) -> None:
            counts[direction] += 1

        # The micro-batch is made (and cached) first: products of the job's own data pipeline are no products
        # of the model, and the faulted runs, which read the cache, never compute them.
        self.data(step, self.rank)
        dist.all_reduce = counting
        try:
            with ProductMode(count):
                return guard.step(step)
        finally:
            dist.all_reduce = original

    # -- (2) the clean checks -------------------------------------------------------------------------

    def clean_checks(self) -> None:
        """Every configuration on the clean run: alarms (must be none) and a bit-identical final state."""
        end = self.settings["last_step"]
        record: dict[str, Any] = {"kind": "clean_checks", "configs": {}}
        for name in self.plan["fault_configs"]:
            record["configs"][name] = self._clean_run(name, 0, end)
        restart = self.settings["first_step"]
        record["restart"] = self._clean_run("none", restart, end)
        record["restart"]["from_step"] = restart
        self._write(record)
        self._say(f"clean checks done ({len(record['configs'])} configurations)")

    def trigger_histories(self) -> None:
        """The magnitude trigger's clean history at every step, for each configuration that runs it (the clean
        checks keep them as they go; a world without them, or a replay, trains those clean runs for them)."""
        for name in self.plan["fault_configs"]:
            if detectors.trigger_on(self.configs[name]) and name not in self.trigger_states:
                self._clean_run(name, 0, self.settings["last_step"])

    def _clean_run(self, name: str, start: int, end: int) -> dict[str, Any]:
        guard, module, optimizer = self.guard(name, start)
        alarms: list[dict[str, Any]] = []
        counters: dict[str, int] = {}
        trigger = guard.trigger if start == 0 else None
        states = self.trigger_states.setdefault(name, {}) if trigger is not None else {}
        started = time.perf_counter()
        for step in range(start, end):
            if trigger is not None:
                states[step] = trigger.state()
            result = guard.step(step)
            _count_flags(result, counters)
            if result.alarm is not None:
                alarms.append({"step": step, "detector": result.alarm.detector.value,
                               "suspects": result.alarm.suspect_ranks})
        identical = self._all(torch.equal(_flat_state(module, optimizer)[1], self.clean_state[end]))
        seconds = time.perf_counter() - started
        del guard
        return {"alarms": alarms, "identical": identical, "steps": end - start, "seconds": seconds,
                "flags": counters}

    # -- (3) the faults -------------------------------------------------------------------------------

    def claimed(self, faults: list[dict[str, Any]]) -> Iterator[tuple[int, FaultSpec]]:
        """The faults this world runs, with their place in the plan: in plan order, each that no other world has
        claimed yet (rank 0 claims it by creating its file, then tells the others: a collective)."""
        claims = self.out / "claims"
        index = -1
        while True:
            mine = torch.tensor([-1], dtype=torch.int64, device=self.device)
            if self.rank == 0:
                for i in range(index + 1, len(faults)):
                    try:
                        os.close(os.open(claims / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        continue
                    mine[0] = i
                    break
            dist.broadcast(mine, src=0)
            index = int(mine.item())
            if index < 0:
                return
            yield index, FaultSpec.from_dict(faults[index])

    def fault(self, fault: FaultSpec, number: int, total: int) -> None:
        """Every run of one fault (the ``number``-th of ``total`` in the plan); rank 0 writes its record."""
        started = time.perf_counter()
        if fault.model == "checkpoint":
            record = self._checkpoint_fault(fault)
        else:
            record = self._compute_fault(fault)
        record["seconds"] = time.perf_counter() - started
        record["world"] = self.index
        self._write(record)
        self._say(f"fault {number} of {total} ({fault.row_id}) in {record['seconds']:.1f} s")
        gc.collect()

    def _compute_fault(self, fault: FaultSpec) -> dict[str, Any]:
        horizon = self.settings["horizon"]
        end = fault.step + horizon
        base = self._run(fault, "none", self._start(fault, "none"), end, stop_after=None)
        runs: dict[str, Any] = {}
        for name in self.plan["fault_configs"]:
            shown = detectors.silence_shown_by(self.configs[name])
            if self.plan.get("derive") and shown is not None and base[shown]:
                # The run without detectors shows this detector's input never left its clean range: trained, its
                # run would take the same steps and pass each one (see detectors.silence_shown_by).
                runs[name] = {"alarm": None, "last_step": base["last_step"], "fired": base["fired"], "flags": {},
                              "derived": shown}
                continue
            runs[name] = self._run(fault, name, self._start(fault, name), end, stop_after=base["benign_at"])
        start = base["series_start"]
        return {"kind": "fault", "fault": fault.to_dict(), "start": start, "end": end, "none": base, "runs": runs}

    def _start(self, fault: FaultSpec, name: str) -> int:
        """Where a run of ``name`` starts: a few clean steps before the fault (the trigger brings its history)."""
        return max(1, fault.step - self.settings["lead"])

    def _run(self, fault: FaultSpec, name: str, start: int, end: int, stop_after: int | None) -> dict[str, Any]:
        """One faulted run under configuration ``name``, until its first alarm, a known-benign state, ``end``,
        or the last step at which ``name`` could raise an alarm (a sampled detector's last due step)."""
        assert self.shape is not None
        end = min(end, detectors.last_alarm_step(self.configs[name], start, end) + 1)
        guard, module, optimizer = self.guard(name, start)
        inst = install(fault, rank=self.rank, module=module, optimizer=optimizer, shape=self.shape)
        probe = _Probe(module) if name == "none" else None
        watch = _ReducedWatch(module, optimizer) if name == "none" else None
        losses: list[float] = []
        norms: list[float] = []
        alarm: dict[str, Any] | None = None
        benign_at: int | None = None
        counters: dict[str, int] = {}
        step = start
        try:
            for step in range(start, end):
                inst.begin_step(step)
                if probe is not None:
                    probe.begin_step()
                with inst.active():
                    result = guard.step(step)
                _count_flags(result, counters)
                losses.append(result.loss)
                if probe is not None:
                    norms.append(probe.norm())
                if result.alarm is not None:
                    alarm = self._alarm(result.alarm, name, start, fault)
                    break
                if step >= fault.last_step:
                    if stop_after is not None and step >= stop_after:
                        break
                    if name == "none" and self._all(torch.equal(_flat_state(module, optimizer)[1],
                                                                self.clean_state[step + 1])):
                        # Back on the clean trajectory after the fault's last step: the rest is the clean run.
                        benign_at = step
                        break
        finally:
            inst.remove()
            if probe is not None:
                probe.remove()
            if watch is not None:
                watch.remove()
        fired = sum(row[0] for row in self._gather([float(inst.fired)]))
        out: dict[str, Any] = {"alarm": alarm, "last_step": step, "fired": int(fired), "flags": counters}
        if watch is not None:
            out.update(self._outcome(module, optimizer, step + 1, losses, norms, start, watch))
            out["benign_at"] = benign_at
        del guard
        return out

    def _outcome(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, at: int, losses: list[float],
                 norms: list[float], start: int, watch: _ReducedWatch | None = None) -> dict[str, Any]:
        """The faulted run's end state against the clean run's at the same step, and its series (every rank's).

        With ``watch`` (the run without detectors), also whether every loss, local and reduced gradient of every
        rank was finite at every step (``all_finite``), and whether every rank received the same reduced
        gradients at every step (``reduced_identical``)."""
        weights, state = _flat_state(module, optimizer)
        clean_w = self.clean_weights[at]
        exact = bool(torch.equal(state, self.clean_state[at]))
        finite = bool(torch.isfinite(state).all())
        rel = float((weights.double() - clean_w.double()).norm() / clean_w.double().norm())
        rel = rel if math.isfinite(rel) else math.inf
        seen = [float(watch.finite), *watch.words()] if watch is not None else []
        head = 3 + len(seen)
        rows = self._gather([float(exact), float(finite), rel, *seen, *losses, *norms])
        n = len(losses)
        out = {
            "end_step": at,
            "exact_final": all(bool(r[0]) for r in rows),
            "finite_final": all(bool(r[1]) for r in rows),
            "weight_rel": max(r[2] for r in rows),
            "losses": [[rows[r][head + s] for r in range(self.world)] for s in range(n)],
            "norms": [[rows[r][head + n + s] for r in range(self.world)] for s in range(n)],
            "series_start": start,
        }
        if watch is not None:
            series = [v for r in rows for v in r[head:]]  # every loss and local gradient norm of every rank
            out["all_finite"] = all(bool(r[3]) for r in rows) and all(math.isfinite(v) for v in series)
            out["reduced_identical"] = all(r[4:head] == rows[0][4:head] for r in rows)
        return out

    def _alarm(self, alarm: Alarm, name: str, start: int, fault: FaultSpec) -> dict[str, Any]:
        """The first alarm of a run, with the checkpoint the pipeline would roll back to."""
        # The run began at ``start`` from the clean run's state, where the sampled
        # detectors had last passed at their cadence: give the alarm that history.
        cadences = {"ring_audit": self.configs[name].get("audit_every", GuardConfig.audit_every),
                    "weight_fingerprint": self.configs[name].get("fingerprint_every", GuardConfig.fingerprint_every)}
        history = {}
        for detector, every in cadences.items():
            if every and getattr(alarm.last_clean, detector) is None and start >= 1:
                history[detector] = (start - 1) // every * every
        full = alarm.model_copy(update={"last_clean": LastClean(**{**alarm.last_clean.model_dump(), **history})})
        trusted = full.trusted_through_step()
        every = self.settings["checkpoint_every"]
        rollback = trusted // every * every if trusted >= 0 else 0
        persistence = getattr(alarm, "fault_persistence", None)
        return {"step": alarm.step, "detector": alarm.detector.value, "suspects": alarm.suspect_ranks,
                "localized": alarm.localized, "trusted_through": trusted, "rollback_step": rollback,
                "rollback_ok": rollback <= fault.step,
                "fault_persistence": getattr(persistence, "value", persistence)}

    # -- checkpoint faults ----------------------------------------------------------------------------

    def _checkpoint_fault(self, fault: FaultSpec) -> dict[str, Any]:
        earlier, last = fault.extra["checkpoints"]
        # A rank's RNG object holds Python's random state (agent.checkpoint.rng_state), seeded from the OS at
        # start: its bytes, and so where the fault's byte lands, would differ from run to run. Seed it per row.
        random.seed(f"{self.settings['seed']}/{fault.row_id}/{self.rank}")
        prefix = self.scratch / "checkpoints" / fault.row_id.replace("/", "-")
        if self.rank == 0:
            shutil.rmtree(prefix, ignore_errors=True)
            prefix.mkdir(parents=True)
        dist.barrier()
        corrupted = [0]
        hits: list[tuple[int, int]] = []
        writer = CheckpointWriter(str(prefix), corrupt=checkpoint_corrupter(fault, self.rank, corrupted, hits))
        guard, _, _ = self.guard("none", earlier, checkpoints=writer)
        guard.save_checkpoint(earlier)
        for step in range(earlier, last):
            guard.step(step)
        guard.save_checkpoint(last)
        del guard
        first = hits[0] if hits else (0, 0)
        gathered = self._gather([float(corrupted[0]), float(first[0]), float(first[1])])
        fired = int(sum(r[0] for r in gathered))
        # Where the first flipped byte landed (the object's size and the offset), on the rank that flipped it.
        landed = next(([int(r[1]), int(r[2])] for r in gathered if r[0]), None)

        # sdcguard: the agent's verified resume.
        verifier, _, _ = self.guard("all" if "all" in self.configs else "none", 0,
                                    checkpoints=CheckpointWriter(str(prefix)))
        try:
            resumed: int | None = verifier.resume_step()
            refused = None
        except CheckpointCorrupt as exc:
            resumed, refused = None, str(exc)[:300]
        del verifier
        # The pipeline's choice for a restart that must not trust the refused checkpoint.
        chosen: int | None = None
        if self.rank == 0:
            try:
                chosen = select_checkpoint(LocalStore(prefix), trusted_through_step=last).step
            except NoSafeCheckpoint:
                chosen = None
        verified = {"resumed": resumed, "refused": refused, "rollback_step": chosen,
                    "rollback_ok": chosen is None or not fault.fires(chosen)}

        # No verification: what a loader that trusts the bytes does.
        horizon = self.settings["horizon"]
        guard, module, optimizer = self.guard("none", 0)
        problem = None
        try:
            store = LocalStore(prefix)

            def load(name: str) -> Any:
                data, _ = store.get_bytes(f"{checkpoint_dir(last)}/{name}")
                return torch.load(io.BytesIO(data), weights_only=True)

            trainer = load(TRAINER)
            module.load_state_dict(load(MODEL))
            optimizer.load_state_dict(load(OPTIMIZER))
            torch.set_rng_state(load(rng_name(self.rank))["torch"])
            wrong_step = trainer.get("step") != last
        except Exception as exc:  # a loader without checks fails however the bytes make it fail
            problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            wrong_step = False
        loud = not self._all(problem is None)
        unverified: dict[str, Any] = {"loud": loud, "problem": problem, "wrong_step": wrong_step}
        if not loud:
            probe = _Probe(module)
            losses, norms = [], []
            for step in range(last, last + horizon):
                probe.begin_step()
                losses.append(guard.step(step).loss)
                norms.append(probe.norm())
            probe.remove()
            unverified.update(self._outcome(module, optimizer, last + horizon, losses, norms, last))
            unverified["exact_final"] = unverified["exact_final"] and not self._any_wrong(wrong_step)
        del guard
        if self.rank == 0:
            shutil.rmtree(prefix, ignore_errors=True)
        return {"kind": "checkpoint_fault", "fault": fault.to_dict(), "fired": fired, "landed": landed,
                "verified": verified,
                "unverified": unverified}

    def _any_wrong(self, flag: bool) -> bool:
        return not self._all(not flag)

    # -- (4) the clean soak ---------------------------------------------------------------------------

    def soak(self) -> None:
        """Clean training at the defaults: alarms (false alarms), the guard's flags, and the baselines' series."""
        steps = self.settings["soak_steps"]
        guard, module, _ = self.guard("defaults", 0)
        probe = _Probe(module)
        alarms: list[dict[str, Any]] = []
        counters: dict[str, int] = {}
        losses, norms = [], []
        started = time.perf_counter()
        for step in range(steps):
            if step and step % SOAK_PROGRESS_EVERY == 0:
                self._say(f"soak at step {step:,} of {steps:,} ({time.perf_counter() - started:.0f} s)")
            probe.begin_step()
            result = guard.step(step)
            _count_flags(result, counters)
            losses.append(result.loss)
            norms.append(probe.norm())
            if result.alarm is not None:
                alarms.append({"step": step, "detector": result.alarm.detector.value,
                               "suspects": result.alarm.suspect_ranks, "message": result.alarm.message[:200]})
        seconds = time.perf_counter() - started
        probe.remove()
        del guard
        rows = self._gather(losses + norms)
        self._say(f"soak done: {steps * self.world:,} rank-steps in {seconds:.0f} s")
        self._write({"kind": "soak", "steps": steps, "rank_steps": steps * self.world, "seconds": seconds,
                     "alarms": alarms, "flags": counters,
                     "mean_losses": [sum(rows[r][s] for r in range(self.world)) / self.world for s in range(steps)],
                     "norms": [[rows[r][steps + s] for r in range(self.world)] for s in range(steps)]})


def _count_flags(result: StepResult, counters: dict[str, int]) -> None:
    """Add up the step result's yes/no fields (``audited``, ``overflow``, and whatever the guard adds)."""
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        if isinstance(value, bool) and value:
            counters[f.name] = counters.get(f.name, 0) + 1


SOAK_PROGRESS_EVERY = 5_000
"""Soak steps between two progress lines."""


def device_for(name: str, offset: int = 0) -> torch.device:
    """``cpu``, or for ``cuda`` this rank's GPU (``offset + LOCAL_RANK``: one GPU per rank of every world,
    NCCL between a world's ranks)."""
    if name == "cuda":
        return torch.device("cuda", offset + int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


PROBLEM_EXIT_CODE = 3
"""A rank's exit status when the job cannot be measured; it leaves the reason in ``job_problem.<rank>``."""


def rank_main(plan_path: str) -> None:
    """The entry of every spawned rank: read the plan, run it, leave the process group.

    When the job cannot be measured (JobProblem), the rank writes why to ``job_problem.<rank>`` in the
    plan's folder and exits with PROBLEM_EXIT_CODE, without the teardown's collectives."""
    logging.basicConfig(level=logging.CRITICAL)
    for name in ("agent", "lineage", "campaign"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.pop("SDCGUARD_INJECT", None)
    plan = json.loads(Path(plan_path).read_text())
    out = Path(plan["out"])
    index = int(os.environ.get(WORLD_INDEX_ENV, "0"))
    worlds = int(plan.get("worlds", 1))
    device = device_for(plan["settings"]["device"], index * int(os.environ["WORLD_SIZE"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # Every configuration must run the same kernels, the audit's or not.
    torch.use_deterministic_algorithms(True)
    try:
        worker = Rank(plan, out, index)
        phases = plan["phases"]
        if "faults" in phases or "clean" in phases:
            worker.reference()
    except JobProblem as exc:
        (out / f"job_problem.{index}.{dist.get_rank()}").write_text(str(exc))
        raise SystemExit(PROBLEM_EXIT_CODE) from None
    if "clean" in phases and index == 0:
        worker.clean_checks()
    if "soak" in phases and index == worlds - 1:
        worker.soak()
    if "faults" in phases:
        worker.trigger_histories()
        faults = plan["faults"]
        for place, fault in worker.claimed(faults):
            worker.fault(fault, place + 1, len(faults))
    shutdown()

