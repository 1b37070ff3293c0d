"""What each rank runs in the agent's multi-process tests: scenarios in sequence in one process group.

Starting processes dominates on a small machine, so one launch runs many
scenarios; each builds a fresh model, optimizer and guard, trains until its
first alarm (or its last step), and writes what it saw to ``rank-R.json``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent.config import GuardConfig
from agent.guard import SDCGuard
from agent.inject import Injection
from agent.train import JobShape, SyntheticData, build, init_process_group, loss_fn, shutdown
from agent.weights import state_fingerprint_hex
from lineage.errors import CheckpointCorrupt


def run(out_dir: str, scenarios: list[dict[str, Any]], ranks_per_node: int) -> None:
    """Every rank: run ``scenarios`` in order, then write ``out_dir/rank-R.json``.

    A scenario with ``"ranks": [...]`` runs in a process group of those ranks
    only (the others wait), which simulates a smaller world in the same launch.
    """
    init_process_group()
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for scenario in scenarios:
        members = scenario.get("ranks")
        # Every rank takes part in creating a group, members or not.
        group = dist.new_group(members) if members else None
        if members is None or rank in members:
            runner = _checkpoint if scenario.get("checkpoint") else _train
            started = time.perf_counter()
            results[scenario["name"]] = runner(scenario, ranks_per_node, group)
            results[scenario["name"]]["seconds"] = time.perf_counter() - started
        dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


def _guard(scenario: dict[str, Any], ranks_per_node: int, group: dist.ProcessGroup | None,
           seed: int | None = None) -> SDCGuard:
    shape = JobShape(seed=scenario.get("seed", 0) if seed is None else seed)
    ddp, optimizer = build(shape, torch.device("cpu"), group)
    scaler = None
    if scenario.get("scaler_init"):
        scaler = torch.amp.GradScaler("cpu", init_scale=scenario["scaler_init"], growth_interval=1000)
    config = GuardConfig(
        on_alarm="continue",
        ranks_per_node=ranks_per_node,
        audit_every=scenario.get("audit_every", 2),
        fingerprint_every=scenario.get("fingerprint_every", 2),
        seed=shape.seed,
        event_bus=os.environ.get("SDCGUARD_EVENT_BUS", "sdcguard"),
        publish_budget_s=5.0,
        checkpoint_prefix=scenario.get("prefix", "unused-checkpoints"),
        spool_dir=os.environ.get("SDCGUARD_SPOOL_DIR", "sdcguard-spool"),
        hyperpod_cluster="ml-cluster",
        eks_cluster="ml-eks",
        namespace="training",
        job_name="gpt-test",
        max_scaler_overflow_steps=scenario.get("max_overflow", 30),
    )
    inject = scenario.get("inject")
    gain = scenario.get("loss_gain")
    # fp32 gradients overflow only when the scale times the gradient does; a
    # gain on the loss makes the scaler's early steps overflow, as in fp16.
    loss = loss_fn if gain is None else (lambda module, batch: loss_fn(module, batch) * gain)
    return SDCGuard(ddp, optimizer, loss_fn=loss, batch_for=SyntheticData(shape, torch.device("cpu")),
                    config=config, scaler=scaler, injection=Injection.parse(inject) if inject else None,
                    group=group)


def _train(scenario: dict[str, Any], ranks_per_node: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    guard = _guard(scenario, ranks_per_node, group)
    track = scenario.get("track_weights", True)
    out: dict[str, Any] = {"alarm": None, "alarm_count": 0, "updated": 0, "overflow": 0, "audits": 0,
                           "weight_checks": 0, "losses_finite": True}
    for step in range(scenario["steps"]):
        before = state_fingerprint_hex(guard.params, guard.optimizer) if track else ""
        result = guard.step(step)
        out["updated"] += result.updated
        out["overflow"] += result.overflow
        out["audits"] += result.audited
        out["weight_checks"] += result.weights_checked
        if result.alarm is None:
            out["losses_finite"] &= bool(torch.isfinite(torch.tensor(result.loss)))
            continue
        out["alarm_count"] += 1
        if out["alarm"] is None:
            out["alarm"] = result.alarm.model_dump(mode="json")
            out["alarm_step_updated"] = result.updated
            out["weights_unchanged"] = (state_fingerprint_hex(guard.params, guard.optimizer) == before) if track else None
            out["published"] = result.published.delivered if result.published else None
            out["spooled"] = result.published.spooled if result.published else None
        if scenario.get("stop_at_alarm", True):
            break
    del guard
    return out


def _checkpoint(scenario: dict[str, Any], ranks_per_node: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Train, save through the guard, then resume into a differently initialised model (whole world only)."""
    guard = _guard(scenario, ranks_per_node, group)
    steps = scenario["steps"]
    for step in range(steps):
        guard.step(step)
    saved = guard.save_checkpoint(steps)
    expected = state_fingerprint_hex(guard.params, guard.optimizer)
    del guard
    fresh = _guard({**scenario, "inject": None}, ranks_per_node, group, seed=12345)
    out: dict[str, Any] = {"saved": saved is not None, "expected": expected,
                           "before_resume": state_fingerprint_hex(fresh.params, fresh.optimizer)}
    try:
        out["resume_step"] = fresh.resume_step()
        out["after_resume"] = state_fingerprint_hex(fresh.params, fresh.optimizer)
        out["refused"] = None
    except CheckpointCorrupt as exc:
        out["resume_step"] = None
        out["refused"] = str(exc)
    return out
