"""The pipeline as the drill sees it: one incident followed through the ledger, state by state."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import datetime

from sdcguard.contract import Alarm, Incident, IncidentState
from sdcguard.infra.drill.report import Story
from sdcguard.infra.drill.stage import Stage

WAITING = IncidentState.AWAITING_APPROVAL
ENDS = frozenset({IncidentState.CLOSED, IncidentState.FALSE_ALARM, IncidentState.CONTAINED, IncidentState.DRY_RUN,
                  IncidentState.NEEDS_ATTENTION, IncidentState.FAILED})
"""The states an incident stays in: the drill stops waiting when it reaches one."""


def _ts(at: datetime) -> float:
    return at.timestamp()


class IncidentWatch:
    """Follows one incident in the ledger and tells each state as it is reached."""

    def __init__(self, stage: Stage, alarm: Alarm, story: Story) -> None:
        from sdcguard.lambdas.ledger import Ledger, idempotency_key, incident_id_for

        self.ledger = Ledger(stage.outputs["LedgerTableName"], stage.client("dynamodb"))
        self.incident_id = incident_id_for(idempotency_key(alarm))
        self.alarm_at = _ts(alarm.time)
        self.story = story
        self.shown = 0
        self.checks_shown: set[tuple[str, str]] = set()

    def current(self) -> Incident | None:
        """The incident, or None while it is not recorded yet."""
        from sdcguard.lambdas.errors import IncidentNotFound

        try:
            return self.ledger.get(self.incident_id)
        except IncidentNotFound:
            return None

    def _tell(self, incident: Incident) -> None:
        """Print the transitions and node-check answers not printed yet, in the order they happened."""
        told: list[tuple[datetime, Callable[[], None]]] = []
        for transition in incident.transitions[self.shown:]:
            told.append((transition.at, functools.partial(self.story.transition, transition, self.alarm_at)))
        self.shown = len(incident.transitions)
        # A node check's Job answers between transitions: told once, when it has its answer.
        for check in incident.node_checks:
            if check.finished and (check.purpose, check.node) not in self.checks_shown:
                self.checks_shown.add((check.purpose, check.node))
                told.append((check.finished_at or incident.updated_at,
                             functools.partial(self.story.node_check, check, self.alarm_at)))
        for _, tell in sorted(told, key=lambda item: item[0]):
            tell()

    def wait(self, states: frozenset[IncidentState], timeout: float) -> Incident:
        """Poll until the incident is in one of ``states`` or has ended; print new transitions and node checks.

        Raises TimeoutError naming the state it was left in.
        """
        deadline = time.monotonic() + timeout
        while True:
            incident = self.current()
            if incident is not None:
                self._tell(incident)
                if incident.state in states or incident.state in ENDS:
                    return incident
            if time.monotonic() > deadline:
                where = incident.state.value if incident else "not recorded"
                raise TimeoutError(f"incident {self.incident_id} still {where} after {timeout:.0f} s")
            time.sleep(0.2)


def entered_at(incident: Incident, state: IncidentState) -> float | None:
    """When ``incident`` entered ``state``, in seconds since the epoch (None if it never did)."""
    at = incident.entered(state)
    return _ts(at) if at is not None else None


def incidents_since(stage: Stage, began_at: datetime) -> list[Incident]:
    """The incidents the ledger opened for the stage's job at or after ``began_at``."""
    from sdcguard.lambdas.ledger import Ledger

    ledger = Ledger(stage.outputs["LedgerTableName"], stage.client("dynamodb"))
    job = stage.seeded["job"]
    return [i for i in ledger.list(hyperpod_cluster=stage.seeded["hyperpod_cluster"])
            if i.alarm.job.job_name == job and i.created_at >= began_at]
