"""The drill's report: a JSON summary, the incident and alarm, and a plot of the three loss curves."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("alarm", "cordon", "approval", "replaced", "resumed")


@dataclass
class LossCurve:
    """Loss per step of one run (the mean over ranks that reported it)."""

    label: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


@dataclass
class Marks:
    """What the plot marks on the step axis."""

    fault_step: int
    alarm_step: int | None
    suspect_window_start: int | None
    """The first step not covered by a clean check (trusted_through_step + 1)."""
    resumed_from_step: int | None


def phase_seconds(times: dict[str, float | None]) -> dict[str, float | None]:
    """Seconds from the alarm to each later phase (None where a phase was not reached).

    ``times`` maps each name of :data:`PHASES` to a wall-clock timestamp (or None).
    """
    start = times.get("alarm")
    out: dict[str, float | None] = {}
    for name in PHASES:
        at = times.get(name)
        out[name] = None if at is None or start is None else round(at - start, 3)
    return out


def timeline_lines(seconds: dict[str, float | None]) -> list[str]:
    """Human-readable timeline rows: phase, seconds after the alarm, and the step since the previous phase."""
    rows = []
    previous = 0.0
    for name in PHASES:
        at = seconds.get(name)
        if at is None:
            rows.append(f"  {name:<9} —")
            continue
        rows.append(f"  {name:<9} +{at:7.2f} s   (+{at - previous:6.2f} s)")
        previous = at
    return rows


def plot_losses(path: Path, curves: list[LossCurve], marks: Marks) -> None:
    """Write a PNG of the loss curves with the fault, the alarm, the suspect window and the resume step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"clean": ("tab:blue", "-"), "faulty": ("tab:red", "--"), "recovered": ("tab:green", ":")}
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    for curve in curves:
        colour, line = styles.get(curve.label, ("tab:gray", "-"))
        ax.plot(curve.steps, curve.losses, line, color=colour, linewidth=1.6, label=curve.label)
    if marks.suspect_window_start is not None and marks.alarm_step is not None:
        ax.axvspan(marks.suspect_window_start, marks.alarm_step, color="tab:orange", alpha=0.15, label="suspect window")
    ax.axvline(marks.fault_step, color="tab:red", alpha=0.6, linewidth=1, label=f"fault (step {marks.fault_step})")
    if marks.alarm_step is not None:
        ax.axvline(marks.alarm_step, color="black", linewidth=1.2, label=f"alarm (step {marks.alarm_step})")
    if marks.resumed_from_step is not None:
        ax.axvline(
            marks.resumed_from_step,
            color="tab:green",
            linewidth=1.2,
            linestyle="-.",
            label=f"resumed from checkpoint (step {marks.resumed_from_step})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("sdcguard drill: clean, faulty until the alarm, recovered")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(directory: Path, summary: dict[str, Any], documents: dict[str, Any]) -> list[Path]:
    """Write ``summary.json`` and one JSON file per document; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in {"summary": summary, **documents}.items():
        path = directory / f"{name}.json"
        path.write_text(json.dumps(content, indent=2, sort_keys=True, default=str) + "\n")
        written.append(path)
    return written
