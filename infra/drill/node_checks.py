"""The capsule replays the pipeline ran on nodes, as the drill reads them from the ledger and judges them.

The pipeline replays the suspect's capsule on the cordoned suspect before
approval (ReproduceOnSuspect) and on every new node before the job resumes
(QualifyReplacement), one Kubernetes Job each, and records each result in the
incident's ``node_checks``. The drill knows the truth it injected (which
node's GPU is faulty, and whether the fault is persistent), so it can say
whether each answer was right; these functions turn the ledger's records into
the summary's fields and those judgements. Pure: no stand-in needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sdcguard.contract import Incident, NodeCheck
from sdcguard.infra.drill.summary import NodeCheckRow


def rows(incident: Incident, alarm_at: float) -> list[NodeCheckRow]:
    """The incident's node checks as summary rows, finish times in seconds after the alarm."""
    return [_row(check, alarm_at) for check in incident.node_checks]


def _row(check: NodeCheck, alarm_at: float) -> NodeCheckRow:
    finished = None if check.finished_at is None else round(check.finished_at.timestamp() - alarm_at, 3)
    return NodeCheckRow(purpose=check.purpose, node=check.node, instance_id=check.instance_id, state=check.state,
                        repeats=check.repeats, matched=check.matched, reproduced=check.reproduced,
                        summary=check.summary, seconds_after_alarm=finished)


@dataclass(frozen=True)
class Reproduction:
    """What the reproduction on the suspect said: ``"k/n"`` (None when it gave no answer), and its line."""

    reproduced: str | None
    line: str


def reproduction(checks: Sequence[NodeCheckRow], node: str) -> Reproduction:
    """The reproduction on ``node``: ``k/n`` repetitions that missed the healthy bits, or None and why not."""
    mine = [c for c in checks if c.purpose == "reproduce" and c.node == node]
    if not mine:
        return Reproduction(None, "not run: the incident recorded no reproduction on the suspect")
    check = mine[-1]
    line = check.summary or check.state
    if check.state in ("passed", "failed") and check.repeats:
        return Reproduction(f"{check.reproduced}/{check.repeats}", line)
    return Reproduction(None, line)


@dataclass(frozen=True)
class Qualification:
    """What qualifying the new nodes said: one node's answer, one per node when several, or None; and the lines."""

    qualified: bool | list[bool | None] | None
    line: str


def qualified(check: NodeCheckRow) -> bool | None:
    """True when the node matched the capsule every time; False when it did not or gave no answer; None: not run."""
    if check.state == "passed":
        return True
    if check.state == "skipped":
        return None
    return False


def qualification(checks: Sequence[NodeCheckRow]) -> Qualification:
    """The qualifications of the new nodes, in the order they were started (or None and why there was none)."""
    mine = [c for c in checks if c.purpose == "qualify"]
    if not mine:
        return Qualification(None, "not qualified: the incident recorded no qualification")
    line = "; ".join(f"{c.node}: {c.summary or c.state}" for c in mine)
    if len(mine) == 1:
        return Qualification(qualified(mine[0]), line)
    return Qualification([qualified(c) for c in mine], line)


def unqualified_nodes(checks: Sequence[NodeCheckRow]) -> list[str]:
    """The new nodes whose qualification ran and did not pass: the job must never run on one."""
    return [c.node for c in checks if c.purpose == "qualify" and qualified(c) is False]


def reproduction_problem(result: Reproduction, *, persistent: bool, leaves_capsule: bool) -> str | None:
    """Why the reproduction's answer contradicts the injected fault, or None when it is what the fault implies.

    A persistent fault on the suspect's GPU must reproduce on every
    repetition; where the alarm leaves no capsule there is nothing to run,
    and the pipeline must say so rather than answer."""
    if not leaves_capsule:
        if result.reproduced is not None:
            return f"the alarm leaves no capsule, yet the reproduction answered {result.reproduced}"
        return None
    if result.reproduced is None:
        return f"the suspect's capsule was not replayed on its node ({result.line})"
    k, _, n = result.reproduced.partition("/")
    if persistent and k != n:
        return f"a persistent fault reproduced {result.reproduced} on its node, not every time ({result.line})"
    return None


def timeline_notes(checks: Sequence[NodeCheckRow]) -> dict[str, str]:
    """The notes the timeline prints beside its ``reproduced`` and ``qualified`` rows."""
    notes = {}
    reproduce = [c for c in checks if c.purpose == "reproduce"]
    if reproduce:
        notes["reproduced"] = "; ".join(f"reproduction on {c.node}: {c.summary or c.state}" for c in reproduce)
    qualify = [c for c in checks if c.purpose == "qualify"]
    if qualify:
        notes["qualified"] = "; ".join(
            f"qualification of {c.node}: {_verdict(c)}" + (f" ({c.summary})" if c.summary else "") for c in qualify)
    return notes


def _verdict(check: NodeCheckRow) -> str:
    return {True: "passed", False: "failed", None: "not run"}[qualified(check)]


def finished_at(checks: Sequence[NodeCheckRow], purpose: str) -> float | None:
    """Seconds after the alarm when the last check of ``purpose`` finished (None when none did)."""
    times = [c.seconds_after_alarm for c in checks if c.purpose == purpose and c.seconds_after_alarm is not None]
    return max(times) if times else None
