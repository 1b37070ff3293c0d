"""What each rank runs in test_agent_loops.py: the guard in the loops people run, scenarios in one process group.

Gradient accumulation (``accum`` micro-batches), clipping, bf16 autocast, an LR
schedule, a GradScaler, frozen parameters and parameters that get no gradient,
with and without injected faults. Each scenario builds a fresh model, optimizer
and guard and writes what it saw into ``rank-R.json`` (as agent_scenarios does).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard, StepResult
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import (
    JobShape,
    SyntheticData,
    TinyGPT,
    init_process_group,
    loss_fn,
    shutdown,
)
from sdcguard.agent.weights import state_fingerprint_hex
from sdcguard.lineage.errors import CheckpointCorrupt
from tests.functional.agent_scenarios import everything_hex


class Branchy(nn.Module):
    """A frozen input layer, a branch only some micro-batches take, and a layer no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 16)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(16, 16)
        self.rare = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, rare: bool) -> torch.Tensor:
        h = F.gelu(self.body(torch.tanh(self.frozen(x))))
        if rare:
            h = h + self.rare(h)
        return self.out(h)


def branchy_batches(accum: int) -> Any:
    def batch_for(step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        out = []
        for i in range(accum):
            g = torch.Generator().manual_seed(7_919 * (step * accum + i) + rank)
            # The rare branch: only micro-batch 1 of even steps, so its parameters get a gradient in some
            # micro-batches of some steps, and none at all in others.
            out.append((torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g), step % 2 == 0 and i == 1))
        return out
    return batch_for


def branchy_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, bool]) -> torch.Tensor:
    return F.mse_loss(module(batch[0], batch[2]).float(), batch[1])


def warmup_cosine(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def run(out_dir: str, scenarios: list[dict[str, Any]], ranks_per_node: int) -> None:
    """Every rank: run ``scenarios`` in order, then write ``out_dir/rank-R.json``."""
    init_process_group()
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for scenario in scenarios:
        started = time.perf_counter()
        runner = {"train": _train, "resume": _resume, "checkpoint_bad": _checkpoint_bad}[scenario.get("kind", "train")]
        results[scenario["name"]] = runner(scenario, ranks_per_node)
        results[scenario["name"]]["seconds"] = time.perf_counter() - started
        dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


class _Job:
    """One scenario's model, optimizer, schedule, scaler and guard, and what its loss function saw."""

    def __init__(self, scenario: dict[str, Any], ranks_per_node: int, *, init_seed: int | None = None) -> None:
        accum = scenario.get("accum", 3)
        self.forwards: list[tuple[bool, str]] = []
        seed = scenario.get("seed", 0) if init_seed is None else init_seed
        torch.manual_seed(seed)
        if scenario.get("model") == "branchy":
            ddp = nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True)
            base_loss, batch_for = branchy_loss, branchy_batches(accum)
        else:
            shape = JobShape(seed=scenario.get("seed", 0))
            model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
            ddp = nn.parallel.DistributedDataParallel(model)
            data = SyntheticData(shape, torch.device("cpu"))
            poison = {tuple(p[:2]): p[2] for p in scenario.get("poison", [])}

            def batch_for(step: int, rank: int) -> list[tuple[Any, ...]]:
                # Micro-batch 1 of a poisoned (step, rank) carries the gain (inf: a sample that breaks any GPU).
                return [(*data(step * accum + i, rank), poison.get((step, rank), 1.0) if i == 1 else 1.0)
                        for i in range(accum)]

            def base_loss(module: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
                return loss_fn(module, batch[:2]) * batch[2]

        def recording_loss(module: nn.Module, batch: Any) -> torch.Tensor:
            self.forwards.append((torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu"))))
            return base_loss(module, batch)

        params = [p for p in ddp.parameters() if p.requires_grad]
        lr = scenario.get("lr", 3e-3)
        if scenario.get("optimizer") == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=lr)
        self.scheduler = None
        if scenario.get("schedule"):
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, warmup_cosine(2, scenario["schedule"]))
        scaler = None
        if scenario.get("scaler_init"):
            scaler = torch.amp.GradScaler("cpu", init_scale=scenario["scaler_init"], growth_interval=2)
        config = GuardConfig(
            on_alarm="continue", ranks_per_node=ranks_per_node, seed=scenario.get("seed", 0),
            audit_every=scenario.get("audit_every", 2), fingerprint_every=scenario.get("fingerprint_every", 2),
            grad_accum_steps=accum, max_grad_norm=scenario.get("max_grad_norm"),
            autocast_dtype=scenario.get("autocast"), trigger_ratio=scenario.get("trigger_ratio", 4.0),
            checkpoint_prefix=scenario.get("prefix", "unused-checkpoints"),
            event_bus=os.environ.get("SDCGUARD_EVENT_BUS", "sdcguard"), publish_budget_s=5.0,
            spool_dir=os.environ.get("SDCGUARD_SPOOL_DIR", "sdcguard-spool"),
            hyperpod_cluster="ml-cluster", eks_cluster="ml-eks", namespace="training", job_name="gpt-test",
        )
        inject = scenario.get("inject")
        self.guard = SDCGuard(ddp, self.optimizer, loss_fn=recording_loss, batch_for=batch_for, config=config,
                              scheduler=self.scheduler, scaler=scaler,
                              injection=Injection.parse(inject) if inject else None)

    def state(self) -> dict[str, Any]:
        """Everything a bit-exact resume must reproduce."""
        guard = self.guard
        out: dict[str, Any] = {"everything": everything_hex(guard),
                               "lr": [float(g["lr"]).hex() for g in self.optimizer.param_groups]}
        if self.scheduler is not None:
            out["scheduler"] = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        if guard.scaler is not None:
            out["scale"] = guard.scaler.get_scale()
        return out


def _flat(params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params])


def _train(scenario: dict[str, Any], ranks_per_node: int) -> dict[str, Any]:
    job = _Job(scenario, ranks_per_node)
    guard = job.guard
    start = _flat(guard.params)
    out: dict[str, Any] = {"alarm": None, "alarm_count": 0, "updated": 0, "audits": 0, "data_faults": [],
                           "grad_norms": [], "lrs": [], "losses": []}
    for step in range(scenario["steps"]):
        before = state_fingerprint_hex(guard.params, guard.optimizer)
        result: StepResult = guard.step(step)
        out["updated"] += result.updated
        out["audits"] += result.audited
        out["grad_norms"].append(result.grad_norm)
        out["losses"].append(result.loss)
        out["lrs"].append(float(job.optimizer.param_groups[0]["lr"]).hex())
        if result.data_fault:
            out["data_faults"].append(step)
        if result.alarm is None:
            continue
        out["alarm_count"] += 1
        if out["alarm"] is None:
            out["alarm"] = result.alarm.model_dump(mode="json")
            out["alarm_step_updated"] = result.updated
            out["weights_unchanged"] = state_fingerprint_hex(guard.params, guard.optimizer) == before
        break
    out["displacement"] = float(torch.linalg.vector_norm(_flat(guard.params) - start))
    out["forwards"] = job.forwards
    out.update(job.state())
    return out


def _resume(scenario: dict[str, Any], ranks_per_node: int) -> dict[str, Any]:
    """Train ``steps`` straight; then ``stop`` steps, a checkpoint, a fresh job resumed from it, the rest."""
    steps, stop = scenario["steps"], scenario["stop"]
    straight = _Job({**scenario, "prefix": scenario["prefix"] + "-straight"}, ranks_per_node)
    for step in range(steps):
        straight.guard.step(step)
    first = _Job(scenario, ranks_per_node)
    for step in range(stop):
        first.guard.step(step)
    saved = first.guard.save_checkpoint(stop)
    at_stop = first.state()
    del first
    resumed = _Job(scenario, ranks_per_node, init_seed=12_345)
    before = resumed.state()
    start = resumed.guard.resume_step()
    for step in range(start, steps):
        resumed.guard.step(step)
    return {"saved": saved is not None, "resume_step": start, "straight": straight.state(),
            "resumed": resumed.state(), "before_resume": before, "at_stop": at_stop}


def _checkpoint_bad(scenario: dict[str, Any], ranks_per_node: int) -> dict[str, Any]:
    job = _Job(scenario, ranks_per_node)
    for step in range(scenario["steps"]):
        job.guard.step(step)
    saved = job.guard.save_checkpoint(scenario["steps"])
    fresh = _Job({**scenario, "inject": None}, ranks_per_node, init_seed=12_345)
    try:
        fresh.guard.resume_step()
        refused = None
    except CheckpointCorrupt as exc:
        refused = str(exc)
    return {"saved": saved is not None, "refused": refused}
