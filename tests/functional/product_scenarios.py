"""What each rank runs in the product-check and warm-up tests (tests/functional/test_product_checks_guard.py).

3 simulated nodes of 1 rank each; one launch runs every scenario in sequence,
each with a fresh model and guard under ``GuardConfig``'s defaults (audit
every 100 steps, so no audit sees these steps), and writes what it saw to
``rank-R.json``. Faults: a bit flip in one output element of one forward or
backward matrix product of the faulty rank's own pass (the campaign's product
fault: a dispatch mode, below the checks' interception, as a faulty kernel is), or a
loss multiplied by a huge factor in the faulty rank's own pass only (a
transient fault that no recomputation reproduces).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.testing.train import JobShape, SyntheticData, build, init_process_group, loss_fn, shutdown
from sdcguard.campaign.injectors import ProductMode, flip
from tests.compiled import rounding_otherwise
from tests.outbox import Outbox

SHAPE = JobShape(vocab=64, dim=32, heads=2, layers=2, seq=16, batch=8, dropout=0.1)




def run(out_dir: str, scenarios: list[dict[str, Any]]) -> None:
    """Every rank: run ``scenarios`` in order, then write ``out_dir/rank-R.json``."""
    init_process_group()
    rank = dist.get_rank()
    results = {s["name"]: _train(s, rank, Path(out_dir)) for s in scenarios}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


def _train(scenario: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    ddp, optimizer = build(SHAPE, torch.device("cpu"))
    if scenario.get("compiled"):
        # A compiled model (module.compile(): DDP wraps it as it is), whose compiled code rounds otherwise.
        ddp.module.compile(backend=rounding_otherwise)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    config = GuardConfig(on_alarm="continue", ranks_per_node=1, seed=SHAPE.seed,
                         product_checks=scenario.get("product_checks", False),
                         spool_dir=str(out / f"spool-{scenario['name']}-{rank}"),
                         checkpoint_prefix=str(out / f"ckpt-{scenario['name']}"),
                         hyperpod_cluster="ml-cluster", eks_cluster="ml-eks", namespace="training",
                         job_name="gpt-test", **scenario.get("config", {}))
    fault = scenario.get("fault") or {}
    mine = fault.get("rank") == rank
    state = {"step": -1, "forwards": 0}

    def loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
        value = loss_fn(module, batch)
        state["forwards"] += 1
        # The own pass is the step's first forward: a recomputation on another node (or the replay) is right.
        if mine and fault.get("kind") == "loss" and state["step"] == fault["step"] and state["forwards"] == 1:
            value = value * fault["factor"]
        return value

    guard = SDCGuard(ddp, optimizer, loss_fn=loss, batch_for=data, config=config, publisher=Outbox(config),
                     injection=None)
    result: dict[str, Any] = {"alarm": None, "alarm_count": 0, "updated": 0, "confirmed_steps": [],
                              "product_flags": 0, "flipped": 0}
    for step in range(scenario["steps"]):
        state["step"], state["forwards"] = step, 0
        with product_fault(fault, step, result) if mine and fault.get("kind") == "product" else \
                contextlib.nullcontext(), script_defaults(scenario):
            outcome = guard.step(step)
        result["updated"] += outcome.updated
        if guard.products is not None:
            result["product_flags"] += int(guard.products.summary()[1])
        if outcome.confirmed:
            result["confirmed_steps"].append(step)
        if outcome.alarm is not None:
            result["alarm_count"] += 1
            if result["alarm"] is None:
                result["alarm"] = outcome.alarm.model_dump(mode="json")
                result["alarm_step_updated"] = outcome.updated
    return result


@contextlib.contextmanager
def script_defaults(scenario: dict[str, Any]) -> Any:
    """torch's default device and dtype set around the step as ``scenario`` says (``"default_device"``,
    ``"default_dtype"``), as a training script may set them (``torch.set_default_device("cuda")``,
    ``torch.set_default_dtype(torch.bfloat16)``) after building its model: the guard's own tensors must
    follow neither."""
    device, dtype = scenario.get("default_device"), scenario.get("default_dtype")
    before = torch.get_default_dtype()
    if device is not None:
        torch.set_default_device(device)
    if dtype is not None:
        torch.set_default_dtype(getattr(torch, dtype))
    try:
        yield
    finally:
        if device is not None:
            torch.set_default_device(None)
        torch.set_default_dtype(before)


@contextlib.contextmanager
def product_fault(fault: dict[str, Any], step: int, result: dict[str, Any]) -> Any:
    """Around the faulty rank's guard step (here, and under FSDP2 in test_sharded_product_checks.py).
    At ``fault["step"]``: flip ``fault["bit"]`` of one element of the ``fault["product"]``-th product in
    ``fault["direction"]`` ("fwd"/"bwd") of the step, once (a transient fault: the own pass runs first)."""
    if step != fault["step"]:
        yield
        return
    count = [0]

    def corrupt(out: torch.Tensor, direction: str) -> None:
        if direction != fault["direction"]:
            return
        if count[0] == fault["product"]:
            flip(out, 5 % out.numel(), fault["bit"])
            result["flipped"] += 1
        count[0] += 1

    with ProductMode(corrupt):
        yield
