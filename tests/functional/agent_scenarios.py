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
import torch.nn.functional as F
from torch import nn

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import DataFaultLimit, SDCGuard
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, init_process_group, loss_fn, shutdown
from sdcguard.agent.weights import state_fingerprint_hex
from sdcguard.lineage.errors import CheckpointCorrupt


class BatchNormNet(nn.Module):
    """A small MLP with batch norm and dropout: a forward in training mode changes its buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(F.relu(self.norm(self.inp(x)))))


def bn_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7_919 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def bn_loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.mse_loss(module(batch[0]), batch[1])


def everything_hex(guard: SDCGuard) -> str:
    """Weights (trainable and frozen), optimizer state and every buffer, batch-norm statistics included."""
    module = guard.model.module
    frozen = [p for p in module.parameters() if not p.requires_grad]
    return state_fingerprint_hex(guard.params, guard.optimizer, [*frozen, *module.buffers()])


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


def _model(scenario: dict[str, Any], shape: JobShape, group: dist.ProcessGroup | None,
           ) -> tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer, Any, Any]:
    """The scenario's DDP model, optimizer, loss function and batch source."""
    if scenario.get("model") == "bn":
        torch.manual_seed(shape.seed)
        ddp = nn.parallel.DistributedDataParallel(BatchNormNet(), process_group=group)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), bn_loss, bn_batch
    if scenario.get("freeze"):
        torch.manual_seed(shape.seed)
        from sdcguard.agent.testing.train import TinyGPT

        model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
        for name, param in model.named_parameters():
            param.requires_grad_(name not in scenario["freeze"])
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad],
                                                             lr=shape.lr)
    else:
        ddp, optimizer = build(shape, torch.device("cpu"), group)
    data = SyntheticData(shape, torch.device("cpu"))
    gain = scenario.get("loss_gain")
    poison = {tuple(p[:2]): p[2] for p in scenario.get("poison", [])}

    # A poisoned micro-batch carries a gain on its loss: inf is a sample that makes the loss infinite on
    # any GPU, 1e36 one whose scaled loss overflows fp32 under a GradScaler (the routine fp16 overflow).
    def batch_for(step: int, rank: int) -> tuple[Any, ...]:
        return (*data(step, rank), poison.get((step, rank), 1.0))

    def loss(module: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
        value = loss_fn(module, batch[:2]) * batch[2]
        # fp32 gradients overflow only when the scale times the gradient does; a
        # gain on the loss makes the scaler's early steps overflow, as in fp16.
        return value if gain is None else value * gain

    return ddp, optimizer, loss, batch_for


def _guard(scenario: dict[str, Any], ranks_per_node: int, group: dist.ProcessGroup | None,
           seed: int | None = None) -> SDCGuard:
    shape = JobShape(seed=scenario.get("seed", 0) if seed is None else seed)
    ddp, optimizer, loss, batch_for = _model(scenario, shape, group)
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
        publish_budget_s=15.0,  # the stand-in answers slowly when the machine is busy
        checkpoint_prefix=scenario.get("prefix", "unused-checkpoints"),
        spool_dir=os.environ.get("SDCGUARD_SPOOL_DIR", "sdcguard-spool"),
        hyperpod_cluster="ml-cluster",
        eks_cluster="ml-eks",
        namespace="training",
        job_name="gpt-test",
        max_scaler_overflow_steps=scenario.get("max_overflow", 30),
        max_data_faults=scenario.get("max_data_faults", 10),
        trigger_ratio=scenario.get("trigger_ratio", 4.0),
    )
    inject = scenario.get("inject")
    return SDCGuard(ddp, optimizer, loss_fn=loss, batch_for=batch_for,
                    config=config, scaler=scaler, injection=Injection.parse(inject) if inject else None,
                    group=group)


def _train(scenario: dict[str, Any], ranks_per_node: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    guard = _guard(scenario, ranks_per_node, group)
    track = scenario.get("track_weights", True)
    out: dict[str, Any] = {"alarm": None, "alarm_count": 0, "updated": 0, "overflow": 0, "audits": 0,
                           "weight_checks": 0, "losses_finite": True, "data_faults": [], "triggered": 0,
                           "confirmed_steps": [], "error": None}
    for step in range(scenario["steps"]):
        before = state_fingerprint_hex(guard.params, guard.optimizer) if track else ""
        try:
            result = guard.step(step)
        except DataFaultLimit as exc:
            out["error"] = {"step": step, "message": str(exc)}
            break
        out["updated"] += result.updated
        out["overflow"] += result.overflow
        out["audits"] += result.audited
        out["weight_checks"] += result.weights_checked
        out["triggered"] += result.triggered
        if result.data_fault:
            out["data_faults"].append(step)
        if result.confirmed:
            out["confirmed_steps"].append(step)
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
    out["everything"] = everything_hex(guard)
    if guard.scaler is not None:
        out["scale"] = guard.scaler.get_scale()
    del guard
    return out


def _checkpoint(scenario: dict[str, Any], ranks_per_node: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Train, save through the guard, then resume into a differently initialised model (in the scenario's group)."""
    guard = _guard(scenario, ranks_per_node, group)
    steps = scenario["steps"]
    for step in range(steps):
        guard.step(step)
    saved = guard.save_checkpoint(steps)
    manifest_world = saved.manifest.world_size if saved is not None and saved.manifest is not None else None
    expected = state_fingerprint_hex(guard.params, guard.optimizer)
    del guard
    fresh = _guard({**scenario, "inject": None}, ranks_per_node, group, seed=12345)
    out: dict[str, Any] = {"saved": saved is not None, "expected": expected, "manifest_world_size": manifest_world,
                           "before_resume": state_fingerprint_hex(fresh.params, fresh.optimizer)}
    try:
        out["resume_step"] = fresh.resume_step()
        out["after_resume"] = state_fingerprint_hex(fresh.params, fresh.optimizer)
        out["refused"] = None
    except CheckpointCorrupt as exc:
        out["resume_step"] = None
        out["refused"] = str(exc)
    return out
