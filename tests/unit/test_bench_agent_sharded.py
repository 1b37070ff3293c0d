"""``bench agent --sharding hsdp`` prints the DDP table's rows, as ratios to the plain FSDP2 step of the same run.

The ranks are replaced by recorded timings (the real run is the benchmark's,
minutes on a small machine); what is checked is the dispatch and what the
tables say about them.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import agent_sharded, bench_agent


def _timings(rows: tuple[str, ...], plain_ms: float, slower: dict[str, float]) -> dict[str, dict[str, list[float]]]:
    """Eight rounds per row: the plain row at ``plain_ms``, the others ``slower[row]`` times that."""
    def series(name: str) -> list[float]:
        return [plain_ms * slower.get(name, 1.0) / 1e3 * (1 + i / 100) for i in range(8)]
    return {"wall": {n: series(n) for n in rows}, "cpu": {n: series(n) for n in rows}}


def test_the_overhead_table_has_every_ddp_row_and_its_ratio_to_plain_fsdp2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Given ranks that measured every row,
    launched: list[tuple[str, ...]] = []

    def ranks(fn: Any, args: tuple[Any, ...]) -> dict[str, dict[str, list[float]]]:
        launched.append(args[3])
        return _timings(args[3], 100.0, {"detector 2 (audit every step)": 1.9,
                                         "a confirmation every step (forced)": 2.0,
                                         "defaults (audit /100, weights /10)": 1.02,
                                         "defaults + product checks": 1.04})

    monkeypatch.setattr(agent_sharded, "_run", ranks)

    # when the benchmark runs with --sharding hsdp,
    assert bench_agent.main(["--sharding", "hsdp", "--only", "overhead,verdict", "--rounds", "4"]) == 0
    out = capsys.readouterr().out

    # the ranks ran every row of the DDP table, with the FSDP2 step as the baseline,
    assert set(launched[0]) == set(bench_agent.CONFIGS)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    expected = [agent_sharded.PLAIN if n == "plain DDP" else n for n in bench_agent.CONFIGS]
    assert [n for n in rows if n != "configuration"] == expected
    assert rows[agent_sharded.PLAIN].split("|")[3].strip() == "1.000"
    assert rows["detector 2 (audit every step)"].split("|")[3].strip() == "1.900"
    assert "an audit step vs a plain step: 1.900 x" in out
    assert "product checks on top of the defaults: 1.040 x plain FSDP2" in out
    assert "+2.0% over the defaults (target <= +5 %)" in out
    assert "a confirmation (one lock-step pass per rank with 2 replica groups, 2 with 3 or more): +1.000 x" in out
    # and the part that measures only the DDP code path says it did not run.
    assert "verdict: not run under --sharding hsdp" in out


def test_the_loop_table_is_a_ratio_to_the_same_fsdp2_loop_without_the_guard(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(agent_sharded, "_run", lambda fn, args: _timings(
        agent_sharded.LOOP_ROWS, 200.0, {agent_sharded.LOOP_ROWS[2]: 2.0}))

    assert bench_agent.main(["--sharding", "hsdp", "--only", "loop", "--loop-rounds", "4"]) == 0

    out = capsys.readouterr().out
    assert "| loop " in out
    assert all(f"| {row:<44} |" in out for row in agent_sharded.LOOP_ROWS)
    assert "an audit step (it recomputes all 4 micro-batches): 2.000 x" in out


def test_failed_ranks_fail_the_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_sharded, "_run", lambda fn, args: None)
    assert bench_agent.main(["--sharding", "hsdp", "--only", "overhead", "--rounds", "4"]) == 1


def test_the_tp_table_is_a_ratio_to_the_same_tp_job_without_the_guard(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    launched: list[Any] = []

    def ranks(fn: Any, args: tuple[Any, ...]) -> dict[str, dict[str, list[float]]]:
        launched.append(fn)
        return _timings(agent_sharded.TP_ROWS, 100.0, {agent_sharded.TP_ROWS[1]: 1.03, agent_sharded.TP_ROWS[2]: 2.5})

    monkeypatch.setattr(agent_sharded, "_run", ranks)
    assert bench_agent.main(["--sharding", "hsdp", "--only", "tp", "--loop-rounds", "4"]) == 0
    out = capsys.readouterr().out
    assert launched == [agent_sharded._tp_rank]
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert rows[agent_sharded.TP_ROWS[0]].split("|")[3].strip() == "1.000"
    assert rows[agent_sharded.TP_ROWS[2]].split("|")[3].strip() == "2.500"
    assert "2 replicas of a TP group of 2" in out
    assert "1.045 x the unguarded TP job" in out
