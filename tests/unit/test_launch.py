"""The one-machine launcher leaves no rank behind.

Given ranks that would wait for ever, ``launch`` stops them: at its time
limit, shortly after another rank failed (instead of gloo's half-hour
timeout), and when the process that launched them is killed outright (the
ranks notice their parent is gone and end themselves).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdcguard.agent.testing import train


def _wait_forever(pid_dir: str) -> None:
    # Written aside and renamed: the test globs for *.pid and reads each at once (it read one still empty).
    scratch = Path(pid_dir, f"{os.environ['RANK']}.tmp")
    scratch.write_text(str(os.getpid()))
    os.replace(scratch, scratch.with_suffix(".pid"))
    time.sleep(3600)


def _rank_one_fails(pid_dir: str) -> None:
    if os.environ["RANK"] == "1":
        raise SystemExit(3)
    _wait_forever(pid_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a parent that is gone) counts as gone.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_ranks_past_the_time_limit_are_stopped(tmp_path: Path) -> None:
    started = time.monotonic()
    codes = train.launch(2, _wait_forever, (str(tmp_path),), timeout=6)
    assert codes == [None, None]
    assert time.monotonic() - started < 30
    assert not any(_alive(int(p.read_text())) for p in tmp_path.glob("*.pid"))


def test_a_failed_rank_stops_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train, "FAILED_RANK_GRACE_S", 1.0)
    started = time.monotonic()
    codes = train.launch(3, _rank_one_fails, (str(tmp_path),), timeout=600)
    assert codes[1] == 3
    assert codes[0] is None  # stopped, not left waiting for rank 1
    assert codes[2] is None
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_ranks_end_when_their_launcher_is_killed(tmp_path: Path, method: str) -> None:
    # (A fresh launcher that has only imported: the one kind of process that may fork its ranks.)
    script = ("import sys; from sdcguard.agent.testing import train; from tests.unit.test_launch import _wait_forever; "
              f"train.launch(2, _wait_forever, ({str(tmp_path)!r},), start_method={method!r})")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            assert parent.poll() is None, "the launcher ended early"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert all(_alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)  # no finally, no atexit: only the ranks themselves can notice
        parent.wait()
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_an_unknown_start_method_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="start_method: must be spawn or fork"):
        train.launch(2, _wait_forever, (str(tmp_path),), start_method="forkserver")
    assert not list(tmp_path.glob("*.pid"))


class _EndsBetweenChecks:
    """A rank that is alive at the loop's check and has ended by the time the launcher picks one to wait on."""

    started: list[_EndsBetweenChecks] = []

    def __init__(self, **_: object) -> None:
        self.checks = 0
        self.exitcode: int | None = None
        self.started.append(self)

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        self.checks += 1
        if self.checks == 1 and self is self.started[0]:
            return True  # the first rank, at the first check; every other rank has already ended
        self.exitcode = 0
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


def test_the_last_rank_ending_between_two_checks_is_an_ordinary_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI once saw StopIteration here: every rank ended between "any alive?" and "wait on an alive one".
    class Context:
        Process = _EndsBetweenChecks

    monkeypatch.setattr(_EndsBetweenChecks, "started", [])
    monkeypatch.setattr(train.multiprocessing, "get_context", lambda method: Context)
    assert train.launch(2, _wait_forever, ("unused",), start_method="fork") == [0, 0]


def _sum_of_ranks(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank()) + 1])
    dist.all_reduce(total)
    index = os.environ[train.WORLD_INDEX_ENV]
    Path(out_dir, f"{index}.{dist.get_rank()}").write_text(f"{total.item()} {os.environ['MASTER_PORT']}")
    dist.destroy_process_group()


def test_worlds_are_independent_process_groups(tmp_path: Path) -> None:
    codes = train.launch(2, _sum_of_ranks, (str(tmp_path),), timeout=120, worlds=2)
    assert codes == [0, 0, 0, 0]
    seen = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(seen) == ["0.0", "0.1", "1.0", "1.1"]
    # Each group summed its own two ranks (1 + 2), at its own rendezvous.
    assert {v[0] for v in seen.values()} == {"3.0"}
    assert seen["0.0"][1] == seen["0.1"][1] != seen["1.0"][1] == seen["1.1"][1]
    with pytest.raises(ValueError, match=r"^worlds: must be >= 1, got 0"):
        train.launch(2, _sum_of_ranks, (str(tmp_path),), worlds=0)
