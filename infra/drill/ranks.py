"""The drill's training processes: the reference job, one forked process per rank.

``python -m sdcguard.infra.drill.ranks`` is a launcher that imports torch (and the
agent, and a boto3 session) once, then reads one run spec path per line on
stdin and, for each, forks one process per rank (world = nodes x ranks per
node, gloo on CPU, one intra-op thread each). A rank runs the reference job of
:mod:`sdcguard.agent.testing.train` under :class:`sdcguard.agent.guard.SDCGuard` (DDP, or with the spec's
``sharding`` "hsdp" FSDP2 with one replica group per node): resume from the resume
pointer if there is one, train to the last step, checkpoint every
``checkpoint_every`` steps, and stop with ``ALARM_EXIT_CODE`` on an alarm
(``on_alarm="stop"``, the agent's default). Forking from this small process,
not from the drill's own (which runs server threads), costs one torch import
for the whole drill instead of one per rank and run.

Each rank writes ``rank-R.json`` into the spec's ``out_dir``: its loss per
step, where it resumed from, the alarm it saw, what became of the alarm on the
publishing rank, and the fingerprint of its final weights and optimizer state.
Rank 0 prints one progress line per checkpoint on stdout; the launcher prints
``{"exit_codes": [...]}`` when every rank of the run has exited.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast

EXIT_TIMEOUT = 124


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(line: str) -> None:
    print(line, flush=True)


def _rank(rank: int, spec: dict[str, Any], port: int) -> None:
    """One rank, ended with ``os._exit``: its record is written, and nothing at exit may hang it.

    (gloo's teardown, or a thread inherited through the fork, could keep a
    finished rank alive; the record and the exit code are all the drill needs.)
    """
    code = 1
    try:
        _train(rank, spec, port)
        code = 0
    except SystemExit as exc:  # on_alarm="stop": ALARM_EXIT_CODE
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _train(rank: int, spec: dict[str, Any], port: int) -> None:
    """One rank: the reference job's loop (sdcguard.agent.testing.train.train) with the drill's bookkeeping."""
    os.environ.update(spec["env"])
    os.environ.update(spec["rank_env"][rank])
    world, per_node = spec["world_size"], spec["ranks_per_node"]
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
                       "LOCAL_WORLD_SIZE": str(per_node)})
    import torch
    import torch.distributed as dist

    from sdcguard.agent.config import GuardConfig
    from sdcguard.agent.guard import SDCGuard
    from sdcguard.agent.testing.train import JobShape, SyntheticData, build, build_sharded, loss_fn
    from sdcguard.agent.weights import state_fingerprint_hex

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shape = JobShape(seed=spec["seed"])
    device = torch.device("cpu")
    data = SyntheticData(shape, device)
    config = GuardConfig.from_env(**spec["guard"])
    sharding = spec.get("sharding", "ddp")
    if sharding == "ddp":
        ddp, optimizer = build(shape, device)
        guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config)
    else:
        model, optimizer, mesh = build_sharded(shape, device, sharding, world // per_node)
        guard = SDCGuard(cast("Any", model), optimizer, loss_fn=loss_fn, batch_for=data, config=config, mesh=mesh)
    out: dict[str, Any] = {"rank": rank, "node": guard.topology.node, "losses": [], "alarm": None,
                           "published": None, "resumed": None, "final_fingerprint": None, "checkpoints": []}
    path = Path(spec["out_dir"], f"rank-{rank}.json")
    start = guard.resume_step()
    if guard.resumed is not None:
        out["resumed"] = {"step": guard.resumed.step, "uri": guard.resumed.uri, "source": guard.resumed.source}
        if rank == 0:
            _say(f"resumed from {guard.resumed.uri} (step {guard.resumed.step}, via the {guard.resumed.source})")
    publish = guard.publisher.publish

    def publish_and_keep(alarm: Any) -> Any:
        outcome = publish(alarm)
        out["published"] = {"delivered": outcome.delivered, "event_id": outcome.event_id,
                            "attempts": outcome.attempts, "spooled": outcome.spooled, "error": outcome.error}
        return outcome

    guard.publisher.publish = publish_and_keep  # type: ignore[method-assign]
    steps, every = spec["steps"], spec["checkpoint_every"]
    began = time.monotonic()
    try:
        for step in range(start, steps):
            result = guard.step(step)  # an alarm publishes, then exits with ALARM_EXIT_CODE
            out["losses"].append([step, result.loss])
            if every and (step + 1) % every == 0:
                guard.save_checkpoint(step + 1)
                out["checkpoints"].append(step + 1)
                if rank == 0:
                    _say(f"step {step + 1:>4}/{steps}  loss {result.loss:.4f}  checkpoint step-{step + 1:09d} saved"
                         f"  ({time.monotonic() - began:.1f} s)")
        # Under HSDP the digest of every shard all replicas agree on (a collective), the same on every rank.
        out["final_fingerprint"] = (state_fingerprint_hex(guard.params, guard.optimizer) if sharding == "ddp"
                                    else guard.state_fingerprint_hex())
    finally:
        # Written on an alarm too (SystemExit passes through here): what this rank saw before it stopped.
        if guard.alarms:
            out["alarm"] = guard.alarms[-1].model_dump(mode="json")
        path.write_text(json.dumps(out))
    dist.barrier()  # every rank has written its record before any exits


def launch(spec: dict[str, Any]) -> list[int]:
    """Fork every rank of ``spec``, wait for them (up to its timeout); their exit codes."""
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, spec, port), daemon=False) for rank in range(spec["world_size"])]
    for p in procs:
        p.start()
    deadline = time.monotonic() + spec.get("timeout_s", 600)
    codes: list[int] = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(5)
            codes.append(EXIT_TIMEOUT)
        else:
            codes.append(p.exitcode if p.exitcode is not None else 1)
    return codes


def main() -> int:
    """Serve run specs from stdin (one path a line) until it closes; print each run's exit codes as JSON."""
    # Imported once here, inherited by every fork: DDP's constructor imports torch._dynamo (seconds).
    for module in ("torch", "torch._dynamo", "sdcguard.agent.guard", "sdcguard.agent.testing.train", "sdcguard.agent.weights", "sdcguard.agent.sharded",
                   "sdcguard.agent.sharded_checkpoint", "torch.distributed.checkpoint", "boto3"):
        importlib.import_module(module)
    import boto3

    # The default session's service models, loaded once: every rank's S3 and EventBridge clients reuse them.
    # Explicit credentials, so the session caches none: each rank resolves its own from the run's environment
    # (the training role's on the stand-in, which enforces IAM).
    for service in ("s3", "events"):
        boto3.client(service, aws_access_key_id="warm-up", aws_secret_access_key="warm-up")
    _say(json.dumps({"ready": True}))
    for line in sys.stdin:
        if line.strip():
            codes = launch(json.loads(Path(line.strip()).read_text()))
            _say(json.dumps({"exit_codes": codes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
