"""The drill's report: what it prints as it goes, the JSON summary, the incident and alarm, and the loss plot.

The drill decides (``sdcguard.infra.drill.flow``); this module says. :class:`Story`
prints each thing the drill saw, in the words a reader follows;
:func:`verdict_lines` are the last lines of ``sdcguard drill``; the files
are the report directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sdcguard.contract import Alarm, NodeCheck
    from sdcguard.contract.incident import Transition
    from sdcguard.infra.drill.summary import ChaosSummary, DrillSummary

PHASES = ("alarm", "cordon", "reproduced", "approval", "replaced", "qualified", "resumed")
"""The timeline's rows: ``reproduced`` when the suspect's capsule replay on its node answered, ``qualified`` when
the last new node's did."""
STEPS = 7
"""The drill's numbered steps, ``[n/7]``: stand-in, clean run, faulty run, pipeline, recovery, comparison, verdict."""

Say = Callable[[str], None]


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


def timeline_lines(seconds: dict[str, float | None], notes: Mapping[str, str] | None = None) -> list[str]:
    """Human-readable timeline rows: phase, seconds after the alarm, the step since the previous phase, and
    ``notes`` by phase (what the node checks said)."""
    rows = []
    previous = 0.0
    notes = notes or {}
    for name in PHASES:
        at = seconds.get(name)
        note = f"   {notes[name]}" if notes.get(name) else ""
        if at is None:
            rows.append(f"  {name:<10} —{note}")
            continue
        rows.append(f"  {name:<10} +{at:7.2f} s   (+{at - previous:6.2f} s){note}")
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


def write_report(directory: Path, summary: DrillSummary, documents: Mapping[str, Any]) -> list[Path]:
    """Write ``summary.json`` and one JSON file per document; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in {"summary": summary.as_json(), **documents}.items():
        path = directory / f"{name}.json"
        path.write_text(json.dumps(content, indent=2, sort_keys=True, default=str) + "\n")
        written.append(path)
    return written


class Story:
    """The drill as it happens, printed through ``say``: one method per thing a reader should see."""

    def __init__(self, say: Say) -> None:
        self.say = say

    def progress(self, tag: str) -> Say:
        """A ``say`` for a sub-process's lines (a training run's rank 0), indented under ``tag``."""
        return lambda line: self.say(f"  {tag:<9} {line}")

    # set-up -----------------------------------------------------------------------------------------

    def seeded(self, cluster: str, nodes: Sequence[Mapping[str, Any]]) -> None:
        """The seeded HyperPod cluster, node by node with its ranks."""
        self.say(f"seeded HyperPod cluster {cluster}: "
                 + ", ".join(f"{n['node_name']} (ranks {n['ranks'][0]}-{n['ranks'][-1]})" for n in nodes))

    def deploying(self, line: str) -> None:
        """One line of the deploy's progress."""
        self.say(f"  deploy: {line}")

    def deployed(self, stack: str, status: str, seconds: float, bus: str, ledger: str) -> None:
        """The stack is up."""
        self.say(f"deployed stack {stack} ({status}) in {seconds:.1f} s: bus {bus}, ledger {ledger}")

    def warming(self) -> None:
        """The Lambda functions' first calls are under way."""
        self.say("warming the stack's Lambda functions (one cold start each on the stand-in) ...")

    def warmed(self, functions: int, seconds: float) -> None:
        """Every function has had its cold start."""
        self.say(f"warmed the stack's {functions} Lambda functions in {seconds:.1f} s "
                 "(the stand-in starts a process per function on its first call)")

    # the runs ---------------------------------------------------------------------------------------

    def clean_run(self, nodes: int, ranks_per_node: int, steps: int, checkpoint_every: int,
                  sharding: str = "ddp") -> None:
        """Step 2 begins."""
        held = ("DDP" if sharding == "ddp" else
                f"HSDP: {nodes} replica groups of {ranks_per_node} shards, one per node")
        self.say(f"[2/{STEPS}] fault-free run: {nodes} nodes x {ranks_per_node} ranks (gloo, CPU, {held}), "
                 f"{steps} steps, checkpoint every {checkpoint_every}")

    def clean_reused(self, run_dir: Path) -> None:
        """Step 2 uses a fault-free run made earlier."""
        self.say(f"  clean     reusing the fault-free run of {run_dir} (the same job and steps)")

    def clean_done(self, fingerprint: str, seconds: float) -> None:
        """The reference fingerprint."""
        self.say(f"  clean     final weights+optimizer fingerprint {fingerprint} ({seconds:.1f} s)")

    def faulty_run(self, fault: str, rank: int, node: str, step: int, prefix: str) -> None:
        """Step 3 begins."""
        self.say(f"[3/{STEPS}] faulty run: {fault} on rank {rank} (node {node}) from step {step}; "
                 f"checkpoints under {prefix}")

    def faulty_hardware(self, node: str, spec: str, replacements_inherit: bool) -> None:
        """The stand-in holds the fault as the node's hardware: the node checks' Jobs there meet it."""
        inherit = "; its replacements inherit it (--replacement-faulty)" if replacements_inherit else ""
        self.say(f"  hardware  {node}'s GPU is faulty on the stand-in ({spec}): a Job on it meets the fault{inherit}")

    def chaos_on(self, rate: float, seed: int) -> None:
        """The chaos knobs are on."""
        self.say(f"  chaos     {rate:g} of the Kubernetes API and SageMaker HyperPod calls fail transiently "
                 f"(throttling, 500, 503; seed {seed}) until the incident ends")

    def alarm(self, alarm: Alarm, exit_codes: Sequence[int]) -> None:
        """What the agent raised."""
        self.say(f"  alarm     {alarm.detector.value} at step {alarm.step}: suspects ranks {alarm.suspect_ranks} on "
                 f"{', '.join(alarm.suspect_nodes) or 'no node'}; update skipped, exit codes "
                 f"{sorted(set(exit_codes))}")

    def published(self, rank: int | None, bus: str, delivered: bool) -> None:
        """Whether the alarm reached the bus."""
        self.say(f"  alarm     published by rank {rank} to bus {bus}: {'delivered' if delivered else 'NOT delivered'}")

    # the pipeline -----------------------------------------------------------------------------------

    def pipeline(self) -> None:
        """Step 4 begins."""
        self.say(f"[4/{STEPS}] incident pipeline (EventBridge rule -> Step Functions -> Lambda handlers), "
                 "from the ledger:")

    def transition(self, transition: Transition, alarm_at: float) -> None:
        """One state the incident reached, in seconds after the alarm."""
        note = f"  {transition.note}" if transition.note else ""
        self.say(f"  pipeline  {transition.state.value:<19} +{transition.at.timestamp() - alarm_at:6.2f} s  "
                 f"({transition.actor}){note}")

    def node_check(self, check: NodeCheck, alarm_at: float) -> None:
        """One node check's answer: the suspect's reproduction or a new node's qualification."""
        at = check.finished_at.timestamp() - alarm_at if check.finished_at else None
        when = f"+{at:6.2f} s" if at is not None else "        "
        job = f" (Job {check.job})" if check.job else ""
        if check.purpose == "reproduce":
            self.say(f"  pipeline  {'reproduction':<19} {when}  on {check.node}: {check.summary or check.state}{job}")
        else:
            verdict = {"passed": "passed", "skipped": "not run"}.get(check.state, "failed")
            self.say(f"  pipeline  {'qualification':<19} {when}  of {check.node}: {verdict}"
                     f"{f' ({check.summary})' if check.summary else ''}{job}")

    def held(self, cordoned: Sequence[str], replaced: Sequence[str], why: str) -> None:
        """Step 5 when no replacement qualified: nothing resumed."""
        again = f" (after {', '.join(replaced)} failed it and was replaced)" if replaced else ""
        self.say(f"[5/{STEPS}] not resumed: {', '.join(cordoned)} failed qualification and stays cordoned{again}; "
                 f"the incident stopped for attention with the job suspended{f' ({why})' if why else ''}")

    def contained(self, instances: Sequence[str], cordoned: bool, suspended: bool) -> None:
        """What the drill found on the cluster while the incident waits."""
        self.say(f"  contained: node(s) {', '.join(instances)} cordoned={cordoned}, job suspended={suspended}")

    def waiting(self, incident_id: str, shown: Sequence[str]) -> None:
        """The incident as ``sdcguard incidents show`` prints it to the reviewer."""
        self.say(f"  the incident waits for a reviewer (sdcguard incidents show {incident_id}):")
        self._quote(shown)

    def kubectl(self, kubeconfig: Path, lines: Sequence[str]) -> None:
        """The kubectl lines an operator runs, in another terminal, to see the containment for themselves."""
        self.say(f"  see it with kubectl, in another terminal: export KUBECONFIG={kubeconfig}")
        for line in lines:
            self.say(f"    $ {line}")

    def reviewer(self, decision: str, incident_id: str, reason: str) -> None:
        """The reviewer's command, as typed."""
        self.say(f"  reviewer: sdcguard {decision} {incident_id} --reason {json.dumps(reason)}")

    def answered(self, answer: Sequence[str]) -> None:
        """What the reviewer's command printed."""
        self._quote(answer)

    def _quote(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.say(f"    | {line}")

    def chaos_tally(self, chaos: ChaosSummary) -> None:
        """What the chaos knobs did, and what absorbed it."""
        for line in chaos_lines(chaos):
            self.say(f"  chaos     {line}")

    # recovery ---------------------------------------------------------------------------------------

    def replaced(self, pairs: Sequence[tuple[str, str | None]], pointer_before: str | None,
                 pointer_after: str) -> None:
        """Step 5 after an approval."""
        self.say(f"[5/{STEPS}] replaced {', '.join(f'{old} -> {new}' for old, new in pairs)}; "
                 f"pointer {pointer_before} -> {pointer_after}; job resumed")

    def released(self, node: str, pointer: str | None) -> None:
        """Step 5 after a rejection."""
        self.say(f"[5/{STEPS}] released: {node} uncordoned, pointer left at {pointer}, job resumed")

    def restarting(self, nodes: Sequence[str], step: int) -> None:
        """The recovered run starts."""
        self.say(f"  restarting the job on {', '.join(nodes)} from the resume pointer (step {step})")

    def fingerprints(self, clean: str, recovered: str, verdict: str) -> None:
        """Step 6: the two fingerprints side by side."""
        self.say(f"[6/{STEPS}] fingerprints: clean     {clean}\n"
                 f"                    recovered {recovered}  -> {verdict}")

    def report(self, directory: Path, written: Sequence[Path]) -> None:
        """Where the report went."""
        self.say(f"report: {directory} ({', '.join(p.name for p in written)})")


def chaos_lines(chaos: ChaosSummary) -> list[str]:
    """The chaos tally in a few lines: faults per call, retries from the stand-in's side and the history's."""
    calls = ", ".join(f"{name} {sum(c.injected.values())}" for name, c in chaos.by_call.items()) or "none"
    lines = [
        f"{chaos.faults_injected} faults injected at rate {chaos.rate:g} (seed {chaos.seed}): {calls}",
        f"{chaos.retries_absorbed} absorbed by a retry of the same call, {chaos.not_retried} not retried; "
        f"{chaos.incidents_opened} incident(s) opened",
    ]
    if chaos.state_retries:
        errors = ", ".join(f"{name} x{n}" for name, n in chaos.state_errors.items())
        lines.append("state retries (execution history): "
                     + ", ".join(f"{state} {n}" for state, n in chaos.state_retries.items())
                     + (f" ({errors})" if errors else ""))
    return lines


def verdict_lines(summary: DrillSummary, failed_step: str | None, failure: str | None) -> list[str]:
    """The end of ``sdcguard drill``: the timeline, the drill's own timings, the chaos tally, the verdict."""
    from sdcguard.infra.drill.node_checks import timeline_notes

    notes = timeline_notes(summary.node_checks or [])
    lines = [f"[7/{STEPS}] timeline (seconds after the alarm):",
             *timeline_lines(summary.phase_seconds or {}, notes)]
    lines.append("  drill     " + ", ".join(f"{k} {v:.1f} s" for k, v in summary.drill_seconds.items()))
    if summary.chaos is not None:
        lines.extend(f"  chaos     {line}" for line in chaos_lines(summary.chaos))
    if failed_step is not None:
        lines.append(f"verdict: FAILED at {failed_step}: {failure}")
        lines.append(f"report: {summary.report_dir or '-'}")
        return lines
    if summary.replacement_outcome and summary.recovered_bit_exact is None:
        recovery = f"not resumed onto an unqualified node: {summary.replacement_outcome}"
    else:
        recovery = (f"resumed from step {summary.resumed_from_step}; "
                    + (f"recovered bit-exact: {str(summary.recovered_bit_exact).lower()}"
                       if summary.decision == "approve" else "no bit-exact claim after a rejection"))
        if summary.replacement_outcome:
            recovery = f"{summary.replacement_outcome}; {recovery}"
    lines.append(
        f"verdict: PASSED  fault {summary.fault} on rank {summary.fault_rank} at step {summary.fault_step}"
        f" -> {summary.detector} alarm at step {summary.alarm_step}, suspects {summary.suspect_instances}"
        f" (localized correctly: {summary.localized_correctly}); {_checks(summary)}; incident "
        f"{summary.incident_state}; {recovery}")
    lines.append(f"report: {summary.report_dir or '-'}")
    return lines


def _checks(summary: DrillSummary) -> str:
    """What the node checks said, for the verdict: the reproduction's ``k/n`` and the qualification(s)."""
    reproduced = (f"reproduced on the suspect {summary.suspect_reproduced}" if summary.suspect_reproduced
                  else f"no reproduction ({summary.suspect_reproduction or 'not recorded'})")
    qualified = summary.replacement_qualified
    if summary.decision != "approve":
        return reproduced
    if qualified is None:
        return f"{reproduced}; replacement not qualified ({summary.replacement_qualification or 'not recorded'})"
    shown = json.dumps(qualified)
    return f"{reproduced}; replacement qualified: {shown}"
