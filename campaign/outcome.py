"""From the runs' records to outcomes: benign or silent, its size, and per detector caught / when / whom.

Everything here is computed from what the runs recorded (``records.py``):
a fault is **benign** when the faulted run's final state (weights and
optimizer state, every rank) is bit-identical to the clean run's at the same
step; otherwise it is a **silent corruption**, sized **catastrophic**
(a non-finite loss or state, or a loss off by 10x or more at some step),
**visible** (the loss at some step or the final weights off by more than 1e-3
relative) or **tiny**. A checkpoint fault whose object no longer loads is
**loud** (the job fails to start: not silent). A detector **caught** a fault
when it fired at or after the fault's first step; it **localised** it when its
alarm is localised and names exactly the faulty rank (one rank per node
here, so: the right node); its **rollback** is right when the checkpoint the
pipeline would resume from holds no update made at or after the fault.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sdcguard.campaign import baselines

SIZES = ("catastrophic", "visible", "tiny")
VISIBLE = 1e-3
CATASTROPHIC_RATIO = 10.0


@dataclass
class Detection:
    """What one detector (or baseline) did about one fault."""

    caught: bool
    step: int | None = None
    latency: int | None = None
    detector: str | None = None
    """Which sdcguard detector raised the alarm (for ``all``: the first that fired)."""
    suspects: list[int] = field(default_factory=list)
    localized: bool = False
    """Localised to exactly the faulty rank's node."""
    rollback_ok: bool | None = None
    persistence: str | None = None
    """The alarm's ``fault_persistence`` (``transient``, ``persistent``, ``unknown``), where the agent says."""


COMPUTE_MODELS = ("matmul_fwd", "matmul_bwd", "mercurial", "activation", "gradient", "null")
"""Faults in a computation, which the owner's replay of its micro-batch repeats or not; the others corrupt
state (weights, optimizer, a received all-reduce), which a replay does not recompute."""


def persistence_right(model: str, fault_persistence: str, said: str | None) -> bool:
    """Whether an alarm's persistence verdict fits a computation fault: a transient one is gone on replay; an
    intermittent or persistent one fires on every pass of its steps, so the replay reproduces it. Always
    False for the state faults (they have no right verdict to count)."""
    if model not in COMPUTE_MODELS:
        return False
    return said == ("transient" if fault_persistence == "transient" else "persistent")


@dataclass
class FaultOutcome:
    """One fault, judged."""

    row_id: str
    model: str
    persistence: str
    rank: int
    step: int
    fired: int
    """How many corruptions the injector applied in the run without detectors (0: the fault never fired)."""
    size: str
    """``benign``, ``loud``, or one of SIZES (a silent corruption)."""
    loss_rel_fault: float
    loss_rel_max: float
    weight_rel: float
    detections: dict[str, Detection]
    bit_class: str = ""
    seconds: float = 0.0

    @property
    def silent(self) -> bool:
        return self.size in SIZES

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rel(value: float, clean: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return abs(value - clean) / abs(clean) if clean else abs(value)


def _size(exact: bool, finite: bool, losses: list[list[float]], clean: list[list[float]],
          weight_rel: float) -> tuple[str, float]:
    """(size class, the largest relative loss change) of a run whose losses are aligned with ``clean``."""
    if exact:
        return "benign", max((_rel(v, c) for row, crow in zip(losses, clean, strict=True)
                              for v, c in zip(row, crow, strict=True)), default=0.0)
    rel_max, ratio = 0.0, 1.0
    nonfinite = not finite
    for row, crow in zip(losses, clean, strict=True):
        for value, c in zip(row, crow, strict=True):
            if not math.isfinite(value):
                nonfinite = True
                continue
            rel_max = max(rel_max, _rel(value, c))
            if value > 0 and c > 0:
                ratio = max(ratio, value / c, c / value)
    if nonfinite or ratio >= CATASTROPHIC_RATIO or not math.isfinite(weight_rel):
        return "catastrophic", math.inf if nonfinite else rel_max
    if max(rel_max, weight_rel) > VISIBLE:
        return "visible", rel_max
    return "tiny", rel_max


def _baselines(fault_step: int, start: int, losses: list[list[float]], norms: list[list[float]],
               reference: dict[str, Any], rank: int, checkpoint_every: int) -> dict[str, Detection]:
    """The loss-spike and MAD baselines on the clean history before ``start`` followed by the run's series;
    a step at which a baseline fires on the clean reference too is no catch."""
    series_losses = reference["losses"][:start] + losses
    series_norms = reference["norms"][:start] + norms
    mean = [sum(row) / len(row) for row in series_losses]
    quiet = clean_firings(reference)
    out: dict[str, Detection] = {}
    for name, firing in (("loss_spike", baselines.loss_spike(mean, fault_step, quiet["loss_spike"])),
                         ("mad", baselines.mad(series_norms, fault_step, ignore=quiet["mad"]))):
        if firing is None:
            out[name] = Detection(caught=False)
            continue
        # A team without sdcguard rolls back to the newest checkpoint before the alarm.
        rollback = firing.step // checkpoint_every * checkpoint_every
        out[name] = Detection(caught=True, step=firing.step, latency=firing.step - fault_step, detector=name,
                              suspects=firing.suspects, localized=firing.suspects == [rank],
                              rollback_ok=rollback <= fault_step)
    return out


def clean_firings(reference: dict[str, Any]) -> dict[str, frozenset[int]]:
    """The steps at which each baseline fires on the clean reference run (its false alarms there)."""
    mean = [sum(row) / len(row) for row in reference["losses"]]
    return baselines.firing_steps(mean, reference["norms"])


def judge_fault(record: dict[str, Any], reference: dict[str, Any], checkpoint_every: int) -> FaultOutcome:
    """A compute fault's record (``kind == "fault"``) judged against the clean reference."""
    fault = record["fault"]
    base = record["none"]
    start = base["series_start"]
    losses = base["losses"]
    clean = reference["losses"][start:start + len(losses)]
    size, rel_max = _size(base["exact_final"], base["finite_final"], losses, clean, base["weight_rel"])
    offset = fault["step"] - start
    rel_fault = max((_rel(v, c) for v, c in zip(losses[offset], clean[offset], strict=True)), default=0.0) \
        if 0 <= offset < len(losses) else 0.0
    detections: dict[str, Detection] = {}
    detections.update(_baselines(fault["step"], start, losses, base["norms"], reference, fault["rank"],
                                 checkpoint_every))
    for name, run in {"none": base, **record["runs"]}.items():
        alarm = run["alarm"]
        if alarm is None:
            detections[name] = Detection(caught=False)
            continue
        detections[name] = Detection(
            caught=True, step=alarm["step"], latency=alarm["step"] - fault["step"], detector=alarm["detector"],
            suspects=alarm["suspects"], localized=bool(alarm["localized"]) and alarm["suspects"] == [fault["rank"]],
            rollback_ok=alarm["rollback_ok"], persistence=alarm.get("fault_persistence"))
    return FaultOutcome(row_id=fault["row_id"], model=fault["model"], persistence=fault["persistence"],
                        rank=fault["rank"], step=fault["step"], fired=base["fired"], size=size,
                        loss_rel_fault=rel_fault, loss_rel_max=rel_max, weight_rel=base["weight_rel"],
                        detections=detections, bit_class=fault["bit_class"], seconds=record.get("seconds", 0.0))


def judge_checkpoint(record: dict[str, Any], reference: dict[str, Any], checkpoint_every: int) -> FaultOutcome:
    """A checkpoint fault's record: the verified resume (sdcguard) and a loader that trusts the bytes."""
    fault = record["fault"]
    last = fault["extra"]["checkpoints"][1]
    unverified, verified = record["unverified"], record["verified"]
    detections: dict[str, Detection] = {"none": Detection(caught=False)}
    if unverified["loud"]:
        size, rel_max, weight_rel = "loud", math.nan, math.nan
        detections.update({"loss_spike": Detection(caught=False), "mad": Detection(caught=False)})
    else:
        losses = unverified["losses"]
        clean = reference["losses"][last:last + len(losses)]
        weight_rel = unverified["weight_rel"]
        size, rel_max = _size(unverified["exact_final"], unverified["finite_final"], losses, clean, weight_rel)
        detections.update(_baselines(last, last, losses, unverified["norms"], reference, fault["rank"],
                                     checkpoint_every))
    refused = verified["refused"] is not None
    detections["checkpoint_verify"] = Detection(caught=refused, step=last if refused else None,
                                                latency=0 if refused else None, detector="checkpoint_verify",
                                                rollback_ok=verified["rollback_ok"] if refused else None)
    return FaultOutcome(row_id=fault["row_id"], model=fault["model"], persistence=fault["persistence"],
                        rank=fault["rank"], step=fault["step"], fired=record["fired"], size=size,
                        loss_rel_fault=math.nan, loss_rel_max=rel_max, weight_rel=weight_rel,
                        detections=detections, bit_class="byte", seconds=record.get("seconds", 0.0))


def judge(records: list[dict[str, Any]], checkpoint_every: int) -> tuple[dict[str, Any], list[FaultOutcome]]:
    """(the reference record, every fault judged) from the lines of ``runs.jsonl``. KeyError without a reference."""
    reference = next(r for r in records if r["kind"] == "reference")
    outcomes = []
    for record in records:
        if record["kind"] == "fault":
            outcomes.append(judge_fault(record, reference, checkpoint_every))
        elif record["kind"] == "checkpoint_fault":
            outcomes.append(judge_checkpoint(record, reference, checkpoint_every))
    return reference, outcomes


def _median(values: list[int]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    return float(ordered[n // 2]) if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def table(outcomes: list[FaultOutcome], rows: list[str]) -> list[dict[str, Any]]:
    """One summary row per detector over ``outcomes`` (one fault model): coverage of the silent ones."""
    silent = [o for o in outcomes if o.silent]
    benign = [o for o in outcomes if o.size == "benign"]
    out = []
    for name in rows:
        if not any(name in o.detections for o in outcomes):
            continue
        caught = [o for o in silent if o.detections.get(name, Detection(False)).caught]
        latencies = [d.latency for d in (o.detections[name] for o in caught) if d.latency is not None]
        row: dict[str, Any] = {
            "detector": name,
            "silent": len(silent),
            "caught": len(caught),
            "coverage": len(caught) / len(silent) if silent else None,
            "localized": sum(o.detections[name].localized for o in caught),
            "latency_median": _median(latencies),
            "latency_max": max(latencies) if latencies else None,
            "rollback_ok": sum(bool(o.detections[name].rollback_ok) for o in caught),
            "persistence_right": sum(persistence_right(o.model, o.persistence, o.detections[name].persistence)
                                     for o in caught),
            "persistence_judged": sum(o.model in COMPUTE_MODELS for o in caught),
            "caught_benign": sum(o.detections.get(name, Detection(False)).caught for o in benign),
        }
        for size in SIZES:
            of_size = [o for o in silent if o.size == size]
            row[f"{size}_caught"] = sum(o.detections.get(name, Detection(False)).caught for o in of_size)
            row[f"{size}_total"] = len(of_size)
        out.append(row)
    return out
