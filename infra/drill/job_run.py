"""Runs of the reference training job for the drill, started and read back from the drill's process.

A :class:`Trainer` keeps one launcher subprocess (``python -m sdcguard.infra.drill.ranks``)
that has imported torch once and forks the ranks of each run; the drill
streams rank 0's progress lines as they come and then reads every rank's
``rank-R.json``. This module does not import torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdcguard.contract import Alarm

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Placement:
    """Where one node's ranks run: the Kubernetes node and the job's pod on it."""

    node_name: str
    pod: str


@dataclass(frozen=True)
class JobRun:
    """One training run: the job, the nodes it runs on, and what (if anything) is injected where."""

    name: str
    """A label for the run (clean, faulty, recovered): the name of its working folder."""
    checkpoint_prefix: str
    """``s3://bucket/prefix`` of the run's checkpoints and resume pointer."""
    placements: Sequence[Placement]
    """One per node, in node order (ranks are laid out node by node)."""
    steps: int
    guard: Mapping[str, Any]
    """GuardConfig fields besides checkpoint_prefix and ranks_per_node (cadences, bus, job identity)."""
    ranks_per_node: int = 2
    checkpoint_every: int = 10
    seed: int = 0
    inject: Mapping[int, str] = field(default_factory=dict)
    """``SDCGUARD_INJECT`` per rank: the fault lives in that rank's process only, as in one GPU."""
    timeout_s: float = 300.0
    sharding: str = "ddp"
    """``ddp``, or ``hsdp``: FSDP2 on a (replicate, shard) mesh with one replica group per node."""

    @property
    def world_size(self) -> int:
        """Ranks in the run."""
        return len(self.placements) * self.ranks_per_node


@dataclass
class RunResult:
    """What a run left behind."""

    run: JobRun
    exit_codes: list[int]
    ranks: list[dict[str, Any]]
    seconds: float
    log_path: Path
    log_offset: int = 0
    """Where this run's lines begin in the launcher's log."""

    @property
    def finished(self) -> bool:
        """Every rank trained to the last step."""
        return bool(self.exit_codes) and all(c == 0 for c in self.exit_codes)

    @property
    def alarm(self) -> Alarm | None:
        """The alarm the ranks stopped on (every rank holds the same one), or None."""
        for rank in self.ranks:
            if rank.get("alarm"):
                return Alarm.model_validate(rank["alarm"])
        return None

    @property
    def published(self) -> dict[str, Any] | None:
        """What became of the alarm on the rank that published it."""
        return next((r["published"] for r in self.ranks if r.get("published")), None)

    @property
    def final_fingerprints(self) -> list[str | None]:
        """Each rank's fingerprint of its final weights and optimizer state (None where it stopped early)."""
        return [r.get("final_fingerprint") for r in self.ranks]

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint step rank 0 resumed from, or None for a start from scratch."""
        resumed = self.ranks[0].get("resumed") if self.ranks else None
        return int(resumed["step"]) if resumed else None

    def mean_losses(self) -> tuple[list[int], list[float]]:
        """Loss per step averaged over the ranks that reported the step."""
        by_step: dict[int, list[float]] = {}
        for rank in self.ranks:
            for step, loss in rank.get("losses", []):
                by_step.setdefault(int(step), []).append(float(loss))
        steps = sorted(by_step)
        return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the ranks wrote to stderr (for a failure message)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class TrainerError(RuntimeError):
    """The launcher process could not start or died."""


class Trainer:
    """The launcher subprocess that forks the ranks of every run; start it early, it imports torch meanwhile.

    ``env`` points the ranks at AWS (the stand-in's ``AWS_*`` variables);
    the ranks' stderr goes to ``log_path``. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        self.env = dict(env)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        child_env.pop("SDCGUARD_INJECT", None)
        self._child = subprocess.Popen(
            [sys.executable, "-m", "sdcguard.infra.drill.ranks"], cwd=ROOT, env=child_env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        self._ready = False
        self._training_envs: dict[str, dict[str, str]] = {}

    def _lines(self) -> Iterator[str]:
        assert self._child.stdout is not None
        for line in self._child.stdout:
            yield line.rstrip("\n")
        raise TrainerError(f"the training launcher exited ({self._child.wait()}); see {self.log_path}")

    def wait_ready(self) -> None:
        """Block until the launcher has imported torch. Raises TrainerError if it died."""
        if self._ready:
            return
        for line in self._lines():
            if line.startswith('{"ready"'):
                self._ready = True
                return

    def run(self, run: JobRun, work_dir: Path, *, progress: Callable[[str], None] = lambda line: None) -> RunResult:
        """Run ``run`` to its end (or its alarm) and read back every rank's record.

        Rank 0's progress lines go to ``progress`` as they arrive. Raises
        ``ValueError`` for a run without nodes or steps and TrainerError when
        the launcher died; a run whose ranks fail returns normally (read
        ``exit_codes``).
        """
        if not run.placements or run.steps < 1:
            raise ValueError(f"run {run.name}: needs at least one node and one step")
        began = time.monotonic()
        self.wait_ready()
        out_dir = work_dir / run.name
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob("rank-*.json"):
            stale.unlink()
        self._log.flush()
        offset = self.log_path.stat().st_size
        spec_path = out_dir / "spec.json"
        spec_path.write_text(json.dumps(_spec(run, out_dir, self._as_training_role(run.checkpoint_prefix)), indent=2))
        assert self._child.stdin is not None
        self._child.stdin.write(f"{spec_path}\n")
        self._child.stdin.flush()
        codes: list[int] = []
        for line in self._lines():
            if line.startswith('{"exit_codes"'):
                codes = list(json.loads(line)["exit_codes"])
                break
            if line:
                progress(line)
        ranks = []
        for rank in range(run.world_size):
            path = out_dir / f"rank-{rank}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "missing": True})
        return RunResult(run, codes, ranks, time.monotonic() - began, self.log_path, offset)

    def _as_training_role(self, checkpoint_prefix: str) -> dict[str, str]:
        """``env`` with the credentials of a role that holds the deployed stack's TrainingPolicy for ``checkpoint_prefix``.

        On AWS the agent runs as the training pods' role; the stand-in
        enforces IAM, so the ranks get exactly what the TrainingPolicy
        allows. Raises TrainerError when no deployed TrainingPolicy covers the prefix.
        """
        from sdcguard.infra.local.training_role import training_role_env

        if checkpoint_prefix not in self._training_envs:
            try:
                self._training_envs[checkpoint_prefix] = training_role_env(self.env, checkpoint_prefix)
            except LookupError as exc:
                raise TrainerError(str(exc)) from exc
        return self._training_envs[checkpoint_prefix]

    def close(self) -> None:
        """Let the launcher finish and exit (it is killed if it does not within 10 s)."""
        if self._child.stdin is not None and not self._child.stdin.closed:
            self._child.stdin.close()
        try:
            self._child.wait(10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        if self._child.stdout is not None:
            self._child.stdout.close()
        self._log.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _spec(run: JobRun, out_dir: Path, env: Mapping[str, str]) -> dict[str, Any]:
    rank_env = []
    for rank in range(run.world_size):
        place = run.placements[rank // run.ranks_per_node]
        values = {"NODE_NAME": place.node_name, "POD_NAME": place.pod, "HOSTNAME": place.pod}
        if rank in run.inject:
            values["SDCGUARD_INJECT"] = run.inject[rank]
        rank_env.append(values)
    return {
        "world_size": run.world_size,
        "ranks_per_node": run.ranks_per_node,
        "steps": run.steps,
        "checkpoint_every": run.checkpoint_every,
        "seed": run.seed,
        "sharding": run.sharding,
        "out_dir": str(out_dir),
        "timeout_s": run.timeout_s,
        "env": {**env, "SDCGUARD_INJECT": ""},
        "rank_env": rank_env,
        "guard": {
            **run.guard,
            "checkpoint_prefix": run.checkpoint_prefix,
            "ranks_per_node": run.ranks_per_node,
            "on_alarm": "stop",
            "spool_dir": str(out_dir / "spool"),
            "seed": run.seed,
            "threads": 1,
        },
    }
