"""How many history events an incident execution can write, read from its ASL definition.

A Standard execution fails outright (``States.Runtime``) once its history
reaches 25,000 events. The replacement wait is the one loop of the incident
machine, so ``ReplacementMaxPolls`` decides whether an execution can get
there: each poll writes the events of every state on the loop, and a poll
whose Lambda call is retried writes three more per retry. The bound here is
the worst case (every retrier of every state on the loop spent, once per
poll), plus every other state of the machine once, with each Map run over
:data:`MAP_ITEMS` items, so it holds whatever path the execution takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HISTORY_LIMIT = 25_000
"""Events one Standard execution may write (a Step Functions quota that cannot be raised)."""
MAP_ITEMS = 25
"""Items a Map of the incident machine runs over at most: BatchReplaceClusterNodes takes 1-25 node ids."""
POLL_SECONDS_PATH = "$.timeouts.replacement_poll_seconds"
"""The Wait state whose loop is the replacement wait is the one that waits this long."""

# Events per state type without retries (entered + exited; a Task also scheduled, started, succeeded;
# a Map also started, succeeded and two per iteration, counted in _state_events).
_BASE = {"Task": 5, "Wait": 2, "Choice": 2, "Pass": 2, "Succeed": 2, "Fail": 1, "Parallel": 4, "Map": 4}
_PER_RETRY = 3  # TaskScheduled, TaskStarted, TaskFailed of the attempt that failed


class HistoryBudgetError(ValueError):
    """The definition has no replacement loop, or the polls asked for could overrun the history."""


def _state_events(state: Mapping[str, Any], map_items: int) -> int:
    kind = state["Type"]
    events = _BASE.get(kind, 2)
    if kind in ("Task", "Parallel", "Map"):
        events += _PER_RETRY * sum(int(r.get("MaxAttempts", 3)) for r in state.get("Retry", []))
    if kind == "Map":
        processor = state.get("ItemProcessor") or state.get("Iterator") or {}
        events += map_items * (2 + _machine_events(processor.get("States", {}), map_items))
    if kind == "Parallel":
        events += sum(_machine_events(branch.get("States", {}), map_items) for branch in state.get("Branches", []))
    return events


def _machine_events(states: Mapping[str, Any], map_items: int) -> int:
    return sum(_state_events(s, map_items) for s in states.values())


def _successors(state: Mapping[str, Any]) -> list[str]:
    out = [state[k] for k in ("Next", "Default") if k in state]
    out += [c["Next"] for c in state.get("Choices", []) if "Next" in c]
    return out


def poll_loop(definition: Mapping[str, Any]) -> list[str]:
    """The states of the replacement wait's loop, starting at its Wait state.

    Raises :class:`HistoryBudgetError` when the definition has no Wait on
    ``$.timeouts.replacement_poll_seconds`` or no path leads back to it.
    """
    states: Mapping[str, Any] = definition["States"]
    waits = [n for n, s in states.items() if s["Type"] == "Wait" and s.get("SecondsPath") == POLL_SECONDS_PATH]
    if len(waits) != 1:
        raise HistoryBudgetError(f"expected one Wait state on {POLL_SECONDS_PATH}, found {waits}")
    start = waits[0]
    # Breadth-first search for the shortest path from the Wait back to itself (no Catch: a caught error leaves the loop).
    frontier: list[list[str]] = [[start]]
    seen = {start}
    while frontier:
        path = frontier.pop(0)
        for following in _successors(states[path[-1]]):
            if following == start:
                return path
            if following not in seen and following in states:
                seen.add(following)
                frontier.append([*path, following])
    raise HistoryBudgetError(f"no path leads from {start} back to itself: the replacement wait is not a loop")


def events_per_poll(definition: Mapping[str, Any]) -> int:
    """The most events one poll of the replacement wait writes (every retry of its states spent)."""
    states = definition["States"]
    return sum(_state_events(states[name], MAP_ITEMS) for name in poll_loop(definition))


def events_outside_the_loop(definition: Mapping[str, Any]) -> int:
    """An upper bound on the events of everything but the loop: every other state once, Maps at full size."""
    loop = set(poll_loop(definition))
    states = definition["States"]
    return 2 + sum(_state_events(s, MAP_ITEMS) for name, s in states.items() if name not in loop)  # + started, ended


def max_polls(definition: Mapping[str, Any], limit: int = HISTORY_LIMIT) -> int:
    """The largest ``ReplacementMaxPolls`` whose worst case stays under ``limit`` events."""
    return (limit - 1 - events_outside_the_loop(definition)) // events_per_poll(definition)


def check_polls(definition: Mapping[str, Any], polls: int, limit: int = HISTORY_LIMIT) -> None:
    """Raise :class:`HistoryBudgetError`, with the arithmetic, when ``polls`` could overrun ``limit``."""
    per_poll, outside = events_per_poll(definition), events_outside_the_loop(definition)
    worst = polls * per_poll + outside
    if worst >= limit:
        raise HistoryBudgetError(
            f"ReplacementMaxPolls={polls}: {polls} polls x {per_poll} events + {outside} for the rest of the "
            f"machine = {worst} events, over the execution history limit of {limit:,}; "
            f"at most {max_polls(definition, limit)} polls fit (lengthen ReplacementPollSeconds instead)"
        )
