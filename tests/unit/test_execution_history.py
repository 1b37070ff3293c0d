"""The execution-history bound of the incident machine: every poll loop, and the replacement rounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sdcguard.infra.deploy.deploy import DeployError, check_history_budget
from sdcguard.infra.deploy.execution_history import (
    HISTORY_LIMIT,
    HistoryBudgetError,
    budget,
    check_budget,
    events_per_poll,
    poll_loop,
    poll_loops,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"ReplacementMaxPolls": 120, "NodeCheckMaxPolls": 70, "MaxReplacementRounds": 2}


def _asl() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ROOT / "stepfunctions" / "incident.asl.json").read_text())
    return loaded


def _template_defaults() -> dict[str, int]:
    from sdcguard.infra.deploy.cfn_yaml import load_template

    parameters = load_template(ROOT / "infra" / "deploy" / "template.yaml")["Parameters"]
    return {name: int(parameters[name]["Default"]) for name in DEFAULTS}


def test_every_wait_of_the_machine_is_a_bounded_loop_and_the_right_ones_repeat_per_round() -> None:
    loops = {loop.wait: loop for loop in poll_loops(_asl())}
    assert set(loops) == {"WaitReproduce", "WaitForReplacement", "WaitQualify"}
    assert {w: (loop.parameter, loop.per_round) for w, loop in loops.items()} == {
        "WaitReproduce": ("NodeCheckMaxPolls", False),  # before approval, once
        "WaitForReplacement": ("ReplacementMaxPolls", True),
        "WaitQualify": ("NodeCheckMaxPolls", True),  # a failed qualification replaces once more
    }
    assert all(loop.events_per_poll >= 9 for loop in loops.values())  # wait + task + choice before retries


def test_the_template_defaults_fit_and_each_poll_or_round_more_costs_what_it_should() -> None:
    asl = _asl()
    assert _template_defaults() == DEFAULTS
    base = budget(asl, DEFAULTS).worst
    assert base < HISTORY_LIMIT
    check_budget(asl, DEFAULTS)
    loops = {loop.wait: loop for loop in poll_loops(asl)}
    one_more_node_poll = budget(asl, {**DEFAULTS, "NodeCheckMaxPolls": 71}).worst - base
    assert one_more_node_poll == loops["WaitReproduce"].events_per_poll + 2 * loops["WaitQualify"].events_per_poll
    one_more_replacement_poll = budget(asl, {**DEFAULTS, "ReplacementMaxPolls": 121}).worst - base
    assert one_more_replacement_poll == 2 * events_per_poll(asl)
    assert budget(asl, {**DEFAULTS, "MaxReplacementRounds": 3}).worst > base + 120 * events_per_poll(asl)


def test_the_bound_counts_every_retry_on_a_loop() -> None:
    asl = _asl()
    base = budget(asl, DEFAULTS).worst
    greedy = json.loads(json.dumps(asl))
    greedy["States"]["CheckReproduce"]["Retry"].append({"ErrorEquals": ["States.ALL"], "MaxAttempts": 10})
    assert budget(greedy, DEFAULTS).worst == base + 70 * 30


def test_too_many_polls_or_rounds_are_refused_with_the_arithmetic() -> None:
    asl = _asl()
    with pytest.raises(HistoryBudgetError, match=r"NodeCheckMaxPolls=300.*WaitQualify polls.*over the execution history"):
        check_budget(asl, {**DEFAULTS, "NodeCheckMaxPolls": 300})
    with pytest.raises(HistoryBudgetError, match="MaxReplacementRounds=5"):
        check_budget(asl, {**DEFAULTS, "MaxReplacementRounds": 5})
    with pytest.raises(HistoryBudgetError, match="no value given for NodeCheckMaxPolls"):
        budget(asl, {"ReplacementMaxPolls": 120})


def test_a_wait_that_does_not_loop_back_is_refused() -> None:
    unlooped = _asl()
    unlooped["States"]["ReproduceDone"]["Default"] = "CollectEvidence"
    with pytest.raises(HistoryBudgetError, match="WaitReproduce back to itself"):
        poll_loops(unlooped)
    assert poll_loop(_asl())[0] == "WaitForReplacement"


def test_deploy_refuses_parameters_that_could_overrun_the_history(tmp_path: Path) -> None:
    asl = tmp_path / "incident.asl.json"
    asl.write_text(json.dumps(_asl()))
    as_given = {k: str(v) for k, v in DEFAULTS.items()}
    check_history_budget(as_given, asl)
    with pytest.raises(DeployError, match="ReplacementMaxPolls=300"):
        check_history_budget({**as_given, "ReplacementMaxPolls": "300"}, asl)
    # A definition whose poll writes more events lowers the bound for the same values.
    heavier = _asl()
    heavier["States"]["CheckQualify"]["Retry"].append({"ErrorEquals": ["States.Timeout"], "MaxAttempts": 99})
    asl.write_text(json.dumps(heavier))
    with pytest.raises(DeployError, match="over the execution history limit"):
        check_history_budget(as_given, asl)
