"""What each rank runs in the sharded (FSDP2) multi-process tests: scenarios in sequence in one process group.

Starting processes dominates on a small machine, so one launch runs every
scenario; each builds a fresh FSDP2 model on its mesh, an optimizer and a
guard, trains until its first alarm (or its last step), and writes what it saw
to ``rank-R.json``. Alarms are "published" to ``alarms-<scenario>-rank-R.jsonl``
(the tests read them back), so no AWS stand-in is needed.

``python -m tests.distributed.sharded_scenarios SPEC`` is the launcher: it
imports torch, FSDP and the agent once, then forks the ranks (each spawned
rank would import them again: seconds of CPU per rank on a small machine).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.agent.testing.inject import Injection
from sdcguard.agent.testing.train import (
    JobShape,
    SyntheticData,
    TinyGPT,
    init_process_group,
    launch,
    loss_fn,
    shutdown,
    train,
)
from sdcguard.contract import Alarm
from sdcguard.lineage.errors import CheckpointCorrupt
from tests.compiled import rounding_otherwise

SHAPE = JobShape(vocab=16, dim=8, heads=2, layers=1, seq=4, batch=2, dropout=0.1, lr=3e-3)
"""The smallest GPT that has every path: two FSDP groups (the block, the root), shards of unequal size on a
mesh of 3, empty shards on a 1-D mesh of 6 (dim 8 over 6 ranks), dropout."""

REFERENCE_FLAGS = ("--dim", "8", "--layers", "1", "--batch", "2")
"""The reference job's size in the tests (``sdcguard.agent.testing.train`` flags); the "reference" scenario trains the same."""
REFERENCE_SHAPE = JobShape(dim=8, layers=1, batch=2)


class FileOutbox(Publisher):
    """Publishes by appending the alarm to a file in the scenario's folder (what the tests read back)."""

    def __init__(self, config: GuardConfig, path: Path) -> None:
        super().__init__(config)
        self.path = path

    def publish(self, alarm: Alarm) -> PublishOutcome:
        with self.path.open("a") as f:
            f.write(alarm.model_dump_json() + "\n")
        return PublishOutcome(delivered=True, event_id=alarm.alarm_id, attempts=1)

    def republish_spooled(self, *, local: bool = True, s3: bool = True) -> dict[str, PublishOutcome]:
        return {}


def sharded_model(mesh: Any, seed: int = 0, shape: JobShape = SHAPE) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A TinyGPT with each block and the root sharded by ``fully_shard`` on ``mesh``, and its AdamW.

    On a 3-D ``("replicate", "shard", "tp")`` mesh each block's MLP is first tensor-parallel on ``mesh["tp"]``
    (``fc`` column-wise, ``out`` row-wise, as DESIGN.md's TP job), then sharded on ``mesh["replicate", "shard"]``."""
    torch.manual_seed(seed)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout)
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
        mesh = mesh[names[:-1]]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fused: one kernel per step, not a DTensor dispatch per parameter and op (half of a step's time here).
    return model, torch.optim.AdamW(model.parameters(), lr=shape.lr, fused=True)


def plain_model() -> tuple[torch.nn.Module, Any]:
    """The capsule factory of the scenarios' model: a plain (unsharded, not TP'd) TinyGPT of ``SHAPE`` and its
    loss (the guard loads the gathered full state into it)."""
    return TinyGPT(SHAPE.vocab, SHAPE.dim, SHAPE.heads, SHAPE.layers, SHAPE.seq, SHAPE.dropout), _capsule_loss


def _capsule_loss(module: torch.nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    return loss_fn(module, batch[:2]) * batch[2]


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    names = names or {3: ("replicate", "shard", "tp"), 2: ("replicate", "shard"), 1: ("shard",)}[len(shape)]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def guard_for(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int, *, seed: int = 0,
              injection: bool = True) -> SDCGuard:
    model, optimizer = sharded_model(mesh, seed)
    if scenario.get("compiled"):
        # Each block compiled (as torchtitan compiles them), by a backend whose code rounds otherwise than eager.
        for block in cast("torch.nn.ModuleList", model.blocks):
            block.compile(backend=rounding_otherwise)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    accum = scenario.get("accum", 1)
    # A poisoned micro-batch carries a gain on its loss: inf is a sample that makes the loss infinite on any GPU.
    poison = {tuple(p[:2]): float(p[2]) for p in scenario.get("poison", [])}

    # Under TP the ranks of a TP group train on one micro-batch (its first rank's), unless the scenario
    # hands them different ones (which the guard must refuse).
    tp = mesh.size(-1) if "tp" in tuple(mesh.mesh_dim_names or ()) and not scenario.get("tp_batches_differ") else 1

    def one(step: int, rank: int) -> tuple[Any, ...]:
        return (*data(step, rank // tp), poison.get((step, rank), 1.0))

    def batch_for(step: int, rank: int) -> Any:
        return one(step, rank) if accum == 1 else [one(step * accum + i, rank) for i in range(accum)]

    def loss(module: torch.nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
        return loss_fn(module, batch[:2]) * batch[2]

    config = GuardConfig(on_alarm="continue", ranks_per_node=scenario.get("ranks_per_node", ranks_per_node),
                         grad_accum_steps=accum,
                         audit_every=scenario.get("audit_every", 2),
                         fingerprint_every=scenario.get("fingerprint_every", 2),
                         confirm=scenario.get("confirm", True),
                         product_checks=scenario.get("product_checks", False),
                         trigger_warmup=scenario.get("trigger_warmup", GuardConfig.trigger_warmup),
                         checkpoint_prefix=scenario.get("prefix", str(out / "unused-checkpoints")),
                         capsule_factory=scenario.get("capsule_factory"),
                         spool_dir=str(out / "spool"), job_name="gpt-sharded-test")
    inject = scenario.get("inject") if injection else None
    outbox = FileOutbox(config, out / f"alarms-{scenario['name']}-rank-{dist.get_rank()}.jsonl")
    return SDCGuard(cast("Any", model), optimizer, loss_fn=loss, batch_for=batch_for, config=config,
                    publisher=outbox, injection=Injection.parse(inject) if inject else None,
                    mesh=handed_mesh(scenario, mesh))


def handed_mesh(scenario: dict[str, Any], mesh: Any) -> Any:
    """The mesh the guard is handed: the model's own, or (``hand``) a part of it or another one the guard
    must refuse for a TP model."""
    hand = scenario.get("hand")
    if hand is None:
        return mesh
    if hand == "tp":
        return mesh["tp"]
    if hand == "fsdp":
        return mesh["replicate", "shard"]
    if hand == "shard":
        return mesh["shard"]
    if hand == "world_tp":
        return init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("tp",))
    return init_device_mesh("cpu", tuple(mesh.shape), mesh_dim_names=tuple(hand))


def run(out_dir: str, scenarios: list[dict[str, Any]], ranks_per_node: int) -> None:
    """Every rank: run ``scenarios`` in order, then write ``out_dir/rank-R.json``."""
    init_process_group()
    rank = dist.get_rank()
    out = Path(out_dir)
    results: dict[str, Any] = {}
    for scenario in scenarios:
        started = time.perf_counter()
        kind = scenario.get("kind", "train")
        # The reference job builds its own mesh; a flip needs none.
        names = tuple(scenario["mesh_names"]) if "mesh_names" in scenario else None
        mesh = make_mesh(tuple(scenario.get("mesh", (3, 2))), names) if kind not in ("flip", "reference") else None
        runner = {"train": _train, "checkpoint": _checkpoint, "resume": _resume, "flip": _flip,
                  "reference": _reference, "unguarded": _unguarded}[kind]
        try:
            results[scenario["name"]] = runner(scenario, mesh, out, ranks_per_node)
        except ValueError as exc:  # a refusal the scenario expects (raised on every rank alike, so no hang)
            if not scenario.get("expect_error"):
                raise
            results[scenario["name"]] = {"error": str(exc)}
        results[scenario["name"]]["seconds"] = time.perf_counter() - started
        dist.barrier()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))
    shutdown()


def _train(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int) -> dict[str, Any]:
    guard = guard_for(scenario, mesh, out, ranks_per_node)
    result: dict[str, Any] = {"alarm": None, "alarms": 0, "updated": 0, "audits": 0, "weight_checks": 0,
                              "losses": [], "data_faults": [], "confirmed": {}, "triggered": 0, "config": {"reduced_grad": guard.config.reduced_grad,
                                                       "fingerprint_every": guard.config.fingerprint_every,
                                                       "audit": guard.audit_enabled}}
    timings: dict[str, list[float]] = {}
    stop = scenario.get("stop_at_alarm", True)
    before = ""
    for step in range(scenario["steps"]):
        if stop:
            before = guard.local_fingerprint_hex()
        started = time.perf_counter()
        r = guard.step(step)
        kind = "audited" if r.audited else ("weights" if r.weights_checked else "plain")
        timings.setdefault(kind, []).append(time.perf_counter() - started)
        result["step_seconds"] = timings
        result["updated"] += r.updated
        result["audits"] += r.audited
        result["weight_checks"] += r.weights_checked
        result["losses"].append(r.loss)
        result["triggered"] += r.triggered
        if r.data_fault:
            result["data_faults"].append(step)
        if r.confirmed:
            result["confirmed"][str(step)] = r.confirmed
        if r.alarm is not None:
            result["alarms"] += 1
            if result["alarm"] is None:
                result["alarm"] = r.alarm.model_dump(mode="json")
                result["alarm_step_updated"] = r.updated
                result["weights_unchanged"] = guard.local_fingerprint_hex() == before if stop else None
            if stop:
                break
    result["final"] = guard.local_fingerprint_hex()
    # Products the checks saw in the last step's own pass (None: product checks off).
    result["products_checked"] = guard.products.checked if guard.products is not None else None
    return result


def _unguarded(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int) -> dict[str, Any]:
    """The same job without the guard (the same model, data and seeds as ``guard_for``'s): its losses."""
    from sdcguard.agent import replay

    model, optimizer = sharded_model(mesh, 0)
    data = SyntheticData(SHAPE, torch.device("cpu"))
    tp = mesh.size(-1) if "tp" in tuple(mesh.mesh_dim_names or ()) else 1
    rank, losses = dist.get_rank(), []
    for step in range(scenario["steps"]):
        optimizer.zero_grad(set_to_none=True)
        # The guard's seeds: one per micro-batch, a TP group's drawn with its first rank's.
        replay.seed_micro_batch(GuardConfig.seed, step, rank - rank % tp, torch.device("cpu"))
        loss = loss_fn(model, data(step, rank // tp))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses}


def _checkpoint(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int) -> dict[str, Any]:
    """Train ``steps``, save through the guard, train on to ``total`` (the run that never stopped)."""
    guard = guard_for(scenario, mesh, out, ranks_per_node)
    for step in range(scenario["steps"]):
        guard.step(step)
    saved = guard.save_checkpoint(scenario["steps"], data_position={"step": scenario["steps"]})
    out_: dict[str, Any] = {"saved": saved is not None, "at_save": guard.local_fingerprint_hex(),
                            "agreed": guard.agreed_fingerprint(scenario["steps"])[0]}
    for step in range(scenario["steps"], scenario.get("total", scenario["steps"])):
        guard.step(step)
    out_["final"] = guard.local_fingerprint_hex()
    out_["rng"] = torch.get_rng_state().sum().item()
    return out_


def _resume(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int) -> dict[str, Any]:
    """A fresh guard (other initial weights) resumes from the prefix and trains on to ``total``."""
    guard = guard_for(scenario, mesh, out, ranks_per_node, seed=12345, injection=False)
    out_: dict[str, Any] = {"refused": None}
    try:
        start = guard.resume_step()
    except CheckpointCorrupt as exc:
        out_["refused"] = f"{type(exc).__name__}: {exc}"
        return out_
    out_["start"] = start
    out_["at_resume"] = guard.local_fingerprint_hex()
    out_["data_position"] = guard.resumed.data_position if guard.resumed else None
    for step in range(start, scenario["total"]):
        guard.step(step)
    out_["final"] = guard.local_fingerprint_hex()
    return out_


def _flip(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int) -> dict[str, Any]:
    """Rank 0 copies the checkpoints at ``source`` to ``prefix`` and flips one byte in the middle of the largest
    shard file of the copy's checkpoint at ``step``."""
    from sdcguard.contract.checkpoint import checkpoint_dir
    from sdcguard.lineage.store import open_store
    from sdcguard.lineage.verify import read_manifest

    flipped = None
    if dist.get_rank() == 0:
        shutil.copytree(scenario["source"], scenario["prefix"])
        store = open_store(scenario["prefix"])
        manifest = read_manifest(store, scenario["step"])
        shard = max((o for o in manifest.objects if o.name.endswith(".distcp")), key=lambda o: o.size)
        path = Path(scenario["prefix"], checkpoint_dir(scenario["step"]), shard.name)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        flipped = shard.name
    return {"flipped": flipped}


def _reference(scenario: dict[str, Any], mesh: Any, out: Path, ranks_per_node: int) -> dict[str, Any]:
    """The reference job's own loop (``sdcguard.agent.testing.train.train``) under HSDP, checkpointing into ``prefix``."""
    config = GuardConfig(ranks_per_node=ranks_per_node, audit_every=2, fingerprint_every=2,
                         checkpoint_prefix=scenario["prefix"], spool_dir=str(out / "spool-reference"),
                         job_name="gpt-sharded-test")
    return train(scenario["steps"], REFERENCE_SHAPE, config, checkpoint_every=scenario["checkpoint_every"],
                 sharding="hsdp")


def rank_env(world: int, ranks_per_node: int) -> dict[str, str]:
    """Per-rank NODE_NAME/POD_NAME/HOSTNAME, as the downward API would set them."""
    env = {}
    for rank in range(world):
        env[f"NODE_NAME@{rank}"] = f"hyperpod-i-0{rank // ranks_per_node:016x}"
        env[f"POD_NAME@{rank}"] = env[f"HOSTNAME@{rank}"] = f"gpt-sharded-worker-{rank}"
    return env


def clean_env() -> dict[str, str]:
    """No injection or settings from the caller's environment leak into the ranks (the replays' allow-list,
    ``SDCGUARD_REPLAY_FACTORIES``, is the machine's, not the job's: it stays)."""
    return {k: "" for k in os.environ if k.startswith("SDCGUARD_") and k != "SDCGUARD_REPLAY_FACTORIES"}


LAUNCHER_IMPORTS = ("torch._dynamo", "torch.distributed.checkpoint", "sdcguard.agent.sharded", "sdcguard.agent.sharded_checkpoint")
"""What a rank would otherwise import on first use (FSDP's DTensors import torch._dynamo: seconds)."""


def main(argv: list[str]) -> int:
    """``SPEC`` (JSON: out_dir, scenarios, world, ranks_per_node, timeout): fork the ranks; 0 when all exit 0."""
    spec = json.loads(Path(argv[0]).read_text())
    for module in LAUNCHER_IMPORTS:
        importlib.import_module(module)
    world, per_node = spec["world"], spec["ranks_per_node"]
    env = {**clean_env(), **rank_env(world, per_node)}
    codes = launch(world, run, (spec["out_dir"], spec["scenarios"], per_node), env=env, timeout=spec["timeout"],
                   start_method="fork")
    print(json.dumps({"exit_codes": codes}), flush=True)
    return 0 if codes == [0] * world else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
