"""How many history events an incident execution can write, read from its ASL definition.

A Standard execution fails outright (``States.Runtime``) once its history
reaches 25,000 events. The incident machine has three poll loops, each a
Wait whose ``SecondsPath`` names its interval: the reproduction on the
suspect and the qualification of the replacement (``NodeCheckMaxPolls``
polls each at most) and the replacement wait (``ReplacementMaxPolls``).
Each poll writes the events of every state on its loop, and a poll whose
Lambda call is retried writes three more per retry. A replacement that does
not qualify is replaced once more: the cycle through the replacement wait,
the qualification and the rejection runs up to ``MaxReplacementRounds``
times, so its states and its loops count once per round.

The bound here is the worst case (every retrier of every state on a loop
spent, on every poll; every Map run over :data:`MAP_ITEMS` items; every
other state once, or once per round on the rounds' cycle), so it holds
whatever path an execution takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HISTORY_LIMIT = 25_000
"""Events one Standard execution may write (a Step Functions quota that cannot be raised)."""
MAP_ITEMS = 25
"""Items a Map of the incident machine runs over at most: BatchReplaceClusterNodes takes 1-25 node ids."""
POLL_SECONDS_PATH = "$.timeouts.replacement_poll_seconds"
"""The replacement wait's Wait state waits this long."""
POLL_LOOPS = {
    POLL_SECONDS_PATH: "ReplacementMaxPolls",
    "$.timeouts.node_check_poll_seconds": "NodeCheckMaxPolls",
}
"""A poll loop's Wait ``SecondsPath`` -> the template parameter that bounds its polls."""
ROUNDS = "MaxReplacementRounds"
"""The template parameter that bounds the replacement rounds (the first one included)."""

# Events per state type without retries (entered + exited; a Task also scheduled, started, succeeded;
# a Map also started, succeeded and two per iteration, counted in _state_events).
_BASE = {"Task": 5, "Wait": 2, "Choice": 2, "Pass": 2, "Succeed": 2, "Fail": 1, "Parallel": 4, "Map": 4}
_PER_RETRY = 3  # TaskScheduled, TaskStarted, TaskFailed of the attempt that failed


class HistoryBudgetError(ValueError):
    """The definition lacks a loop it should have, or the polls asked for could overrun the history."""


@dataclass(frozen=True)
class PollLoop:
    """One poll loop of the machine: its states from the Wait on, and what bounds and repeats it."""

    wait: str
    states: tuple[str, ...]
    parameter: str
    """The template parameter that bounds its polls."""
    events_per_poll: int
    per_round: bool
    """Whether it is on the replacement rounds' cycle (it runs once per round)."""


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
    """Where a state leads without an error (a caught error leaves every loop)."""
    out = [state[k] for k in ("Next", "Default") if k in state]
    out += [c["Next"] for c in state.get("Choices", []) if "Next" in c]
    return out


def _cycle(states: Mapping[str, Any], start: str) -> list[str]:
    """The shortest path from ``start`` back to itself, breadth first; [] when there is none."""
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
    return []


def _reachable(states: Mapping[str, Any], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for following in _successors(states[todo.pop()]):
            if following in states and following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


def _round_cycle(states: Mapping[str, Any], wait: str) -> set[str]:
    """Every state on some cycle through the replacement wait: its strongly connected component."""
    return {s for s in _reachable(states, wait) if wait in _reachable(states, s)}


def poll_loop(definition: Mapping[str, Any]) -> list[str]:
    """The states of the replacement wait's loop, starting at its Wait state.

    Raises :class:`HistoryBudgetError` when the definition has no Wait on
    ``$.timeouts.replacement_poll_seconds`` or no path leads back to it.
    """
    states: Mapping[str, Any] = definition["States"]
    waits = [n for n, s in states.items() if s["Type"] == "Wait" and s.get("SecondsPath") == POLL_SECONDS_PATH]
    if len(waits) != 1:
        raise HistoryBudgetError(f"expected one Wait state on {POLL_SECONDS_PATH}, found {waits}")
    loop = _cycle(states, waits[0])
    if not loop:
        raise HistoryBudgetError(f"no path leads from {waits[0]} back to itself: the replacement wait is not a loop")
    return loop


def poll_loops(definition: Mapping[str, Any]) -> list[PollLoop]:
    """Every poll loop of the machine (a Wait on one of :data:`POLL_LOOPS`' paths), in definition order."""
    states: Mapping[str, Any] = definition["States"]
    rounds = _round_cycle(states, poll_loop(definition)[0])
    found = []
    for name, state in states.items():
        parameter = POLL_LOOPS.get(state.get("SecondsPath", "")) if state["Type"] == "Wait" else None
        if parameter is None:
            continue
        loop = _cycle(states, name)
        if not loop:
            raise HistoryBudgetError(f"no path leads from {name} back to itself: its poll is not a loop")
        found.append(PollLoop(wait=name, states=tuple(loop), parameter=parameter,
                              events_per_poll=sum(_state_events(states[s], MAP_ITEMS) for s in loop),
                              per_round=name in rounds))
    return found


def events_per_poll(definition: Mapping[str, Any]) -> int:
    """The most events one poll of the replacement wait writes (every retry of its states spent)."""
    states = definition["States"]
    return sum(_state_events(states[name], MAP_ITEMS) for name in poll_loop(definition))


@dataclass(frozen=True)
class Budget:
    """The worst case of one execution, and how it adds up."""

    worst: int
    terms: tuple[str, ...]

    def explain(self) -> str:
        """The arithmetic, for an error message."""
        return " + ".join(self.terms) + f" = {self.worst:,} events"


def budget(definition: Mapping[str, Any], parameters: Mapping[str, int]) -> Budget:
    """The most events an execution can write under ``parameters`` (the template's poll bounds and rounds)."""
    states: Mapping[str, Any] = definition["States"]
    loops = poll_loops(definition)
    missing = sorted({loop.parameter for loop in loops} - set(parameters))
    rounds_cycle = _round_cycle(states, poll_loop(definition)[0])
    rounds = parameters.get(ROUNDS, 1)
    if missing:
        raise HistoryBudgetError(f"no value given for {', '.join(missing)}")
    if rounds < 1:
        raise HistoryBudgetError(f"{ROUNDS}={rounds}: at least one round (the first replacement) is needed")
    on_loops = {s for loop in loops for s in loop.states}
    once = sum(_state_events(s, MAP_ITEMS) for n, s in states.items() if n not in on_loops and n not in rounds_cycle)
    per_round = sum(_state_events(states[n], MAP_ITEMS) for n in rounds_cycle - on_loops)
    terms = [f"{once + 2} for the states that run once", f"{rounds} round(s) x {per_round} for the rounds' states"]
    worst = once + 2 + rounds * per_round
    for loop in loops:
        polls = parameters[loop.parameter]
        times = rounds if loop.per_round else 1
        worst += times * polls * loop.events_per_poll
        terms.append(f"{f'{times} x ' if loop.per_round else ''}{polls} {loop.wait} polls x {loop.events_per_poll}")
    return Budget(worst=worst, terms=tuple(terms))


def check_budget(definition: Mapping[str, Any], parameters: Mapping[str, int], limit: int = HISTORY_LIMIT) -> None:
    """Raise :class:`HistoryBudgetError`, with the arithmetic, when ``parameters`` could overrun ``limit``."""
    found = budget(definition, parameters)
    if found.worst >= limit:
        given = ", ".join(f"{k}={v}" for k, v in sorted(parameters.items()))
        raise HistoryBudgetError(
            f"{given}: {found.explain()}, over the execution history limit of {limit:,}; lower the polls "
            f"(lengthen ReplacementPollSeconds or NodeCheckPollSeconds instead) or {ROUNDS}"
        )
