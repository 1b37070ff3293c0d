"""The reference training job: a small GPT-style model on seeded synthetic data, guarded by SDCGuard.

Under torchrun (one process per GPU, or gloo on CPU)::

    torchrun --nproc-per-node 2 -m sdcguard.agent.testing.train --steps 200 --audit-every 50

or on one machine without torchrun, simulating 3 nodes of 2 ranks::

    python -m sdcguard.agent.testing.train --nproc 6 --ranks-per-node 2 --steps 200

Exit status: 0 when training finished, ``ALARM_EXIT_CODE`` (87) when an alarm
stopped it under the default ``on_alarm=stop``, 2 for bad arguments. Copy
``build``/``batch_for``/``loss_fn`` and the loop in ``train`` into your own job.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdcguard.agent import native
from sdcguard.agent.config import GuardConfig
from sdcguard.agent.guard import SDCGuard
from sdcguard.agent.testing import inject
from sdcguard.agent.weights import state_fingerprint_hex

log = logging.getLogger("sdcguard.agent.testing.train")


# -- the model ---------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with dropout."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = self.drop(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        x = x + self.drop(self.proj((attn @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A small GPT: token and position embeddings, ``layers`` blocks, a language-model head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, seq: int = 16,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass(frozen=True)
class JobShape:
    """Sizes of the reference job."""

    vocab: int = 64
    dim: int = 32
    heads: int = 2
    layers: int = 2
    seq: int = 16
    batch: int = 8
    dropout: float = 0.1
    lr: float = 3e-3
    seed: int = 0


class SyntheticData:
    """Seeded sequences from a fixed random Markov chain: learnable, and the same on every rank."""

    def __init__(self, shape: JobShape, device: torch.device) -> None:
        self.shape = shape
        self.device = device
        g = torch.Generator().manual_seed(shape.seed)
        # Each token has a few likely successors, so the loss can fall.
        logits = torch.randn(shape.vocab, shape.vocab, generator=g, dtype=torch.float32, device="cpu") * 3.0
        self.transitions = logits.softmax(dim=-1)

    def __call__(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch ``rank`` trains on at ``step``: (inputs, targets), each [batch, seq]."""
        s = self.shape
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step * 65_537 + rank)
        tokens = torch.empty(s.batch, s.seq + 1, dtype=torch.int64, device="cpu")  # drawn on the host, then moved
        tokens[:, 0] = torch.randint(s.vocab, (s.batch,), generator=g, device="cpu")
        for i in range(1, s.seq + 1):
            tokens[:, i] = torch.multinomial(self.transitions[tokens[:, i - 1]], 1, generator=g).squeeze(1)
        tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]


def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy."""
    inputs, targets = batch
    logits = module(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(shape: JobShape, device: torch.device, group: dist.ProcessGroup | None = None,
          ) -> tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer]:
    """The DDP-wrapped model (identical initial weights on every rank) and its AdamW optimizer."""
    torch.manual_seed(shape.seed)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                              process_group=group)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=shape.lr)


MODEL_SHAPE_ENV = "SDCGUARD_MODEL_SHAPE"
"""``dim=64,layers=4``: the reference model's sizes where they differ from ``JobShape``'s defaults.

:func:`replay_model` rebuilds the model in a fresh process (``sdcguard replay``,
on the pipeline's side a Kubernetes Job whose container env is the training
pods'), from nothing but the capsule and this variable: the capsules the agent
writes name the factory with empty ``factory_args``. ``python -m sdcguard.agent.testing.train``
sets it for its ranks when ``--dim``/``--layers`` differ from the defaults; a
job that changes the model's sizes sets it in its pods' env."""

_MODEL_SIZES = {"vocab": int, "dim": int, "heads": int, "layers": int, "seq": int, "dropout": float}
"""The ``JobShape`` fields that decide the model's parameters and its forward (batch, lr and seed do not)."""


def model_shape(env: Mapping[str, str] | None = None) -> JobShape:
    """``JobShape`` with the sizes ``MODEL_SHAPE_ENV`` gives (the defaults for the rest).

    Raises ``ValueError`` naming the variable for a size it does not know or a value that is not a number."""
    spec = (os.environ if env is None else env).get(MODEL_SHAPE_ENV, "").strip()
    sizes: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in _MODEL_SIZES:
            raise ValueError(f"{MODEL_SHAPE_ENV}: {name!r} is not one of {', '.join(_MODEL_SIZES)} (got {spec!r})")
        try:
            sizes[name] = _MODEL_SIZES[name](value.strip())
        except ValueError:
            raise ValueError(f"{MODEL_SHAPE_ENV}: {name}={value.strip()!r} is not a number") from None
    return JobShape(**sizes)


def shape_spec(shape: JobShape) -> str:
    """``MODEL_SHAPE_ENV``'s value for ``shape``: the model sizes that differ from the defaults ("" for none)."""
    default = JobShape()
    return ",".join(f"{name}={getattr(shape, name)}" for name in _MODEL_SIZES
                    if getattr(shape, name) != getattr(default, name))


def replay_model() -> tuple[nn.Module, Callable[[nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    """The reference job's capsule factory (``SDCGUARD_CAPSULE_FACTORY=sdcguard.agent.testing.train:replay_model``).

    Returns the bare ``TinyGPT`` of the job's sizes (``MODEL_SHAPE_ENV``, else
    the defaults the drill trains) and :func:`loss_fn`; ``sdcguard replay``
    loads the capsule's weights into it. Takes no arguments because the
    capsules the agent writes carry none. Raises ``ValueError`` for a bad
    ``MODEL_SHAPE_ENV``."""
    s = model_shape()
    return TinyGPT(s.vocab, s.dim, s.heads, s.layers, s.seq, s.dropout), loss_fn


# -- the loop ----------------------------------------------------------------------------------------


SHARDINGS = ("ddp", "hsdp", "fsdp")
"""``--sharding``: DDP, FSDP2 on a ("replicate", "shard") mesh, FSDP2 on a 1-D mesh."""


def build_sharded(shape: JobShape, device: torch.device, sharding: str, replicas: int,
                  ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The FSDP2 model (each block, then the root, ``fully_shard`` on the mesh), its AdamW, and the mesh.

    ``hsdp``: ``replicas`` replica groups of world/replicas shards; ``fsdp``: one 1-D mesh of the world.
    Raises ``ValueError`` naming ``--replicas`` when it does not divide the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if sharding == "hsdp":
        if replicas < 2 or world % replicas:
            raise ValueError(f"--replicas: {replicas} replica groups do not divide a world of {world} into 2 or more")
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    torch.manual_seed(shape.seed)
    model = TinyGPT(shape.vocab, shape.dim, shape.heads, shape.layers, shape.seq, shape.dropout).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fused: one kernel per step; the default runs each op of each parameter through DTensor's dispatch,
    # which costs a tiny model more than its forward and backward together.
    return model, torch.optim.AdamW(model.parameters(), lr=shape.lr, fused=True), mesh


def train(steps: int, shape: JobShape, config: GuardConfig, *, checkpoint_every: int = 0,
          on_step: Callable[[Any], None] | None = None, sharding: str = "ddp",
          replicas: int | None = None) -> dict[str, Any]:
    """Train ``steps`` steps in the initialised process group; returns a summary of the run.

    ``sharding`` is one of SHARDINGS; under ``hsdp``, ``replicas`` replica groups (default: one per node).
    An alarm under ``on_alarm="stop"`` exits the process (SystemExit with
    ALARM_EXIT_CODE) after it is published.
    """
    device = _device()
    data = SyntheticData(shape, device)
    if sharding == "ddp":
        ddp, optimizer = build(shape, device)
        guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config)
    else:
        per_node = config.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharded, optimizer, mesh = build_sharded(shape, device, sharding,
                                                 replicas or dist.get_world_size() // per_node)
        ddp = cast("Any", sharded)  # SDCGuard's model slot is typed for DDP; with a mesh it takes FSDP2
        guard = SDCGuard(ddp, optimizer, loss_fn=loss_fn, batch_for=data, config=config, mesh=mesh)
    start = guard.resume_step() if checkpoint_every else 0
    losses: list[float] = []
    alarms = []
    for step in range(start, steps):
        result = guard.step(step)
        losses.append(result.loss)
        if on_step is not None:
            on_step(result)
        if result.alarm is not None:
            alarms.append(result.alarm.model_dump(mode="json"))
        elif checkpoint_every and (step + 1) % checkpoint_every == 0:
            guard.save_checkpoint(step + 1)
    summary = {
        "rank": guard.topology.rank,
        "first_step": start,
        "steps": steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "alarms": alarms,
        "final_fingerprint": (state_fingerprint_hex(guard.params, guard.optimizer) if sharding == "ddp"
                              else guard.state_fingerprint_hex()),
    }
    del guard, ddp, optimizer
    return summary


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_process_group() -> None:
    """Join the job's process group from torchrun's environment (NCCL on GPU, gloo on CPU)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def shutdown() -> None:
    """Leave the process group cleanly (a barrier first: gloo teardown could hang without it)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# -- a launcher for one machine (tests, benchmarks, trying it out) -----------------------------------


def free_port() -> int:
    """A free TCP port on loopback."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback (each held until all are found, so none repeats)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


FAILED_RANK_GRACE_S = 30.0
"""After one rank fails, how long ``launch`` lets the others end on their own before it stops them."""


def _child(fn: Callable[..., Any], rank: int, env: Mapping[str, str], args: Sequence[Any]) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank % int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    _exit_with_parent()
    fn(*args)
    # The rank's work is done (fn left its process group): end here, as a forked child does. The interpreter's
    # teardown destroys torch's C++ objects in no fixed order, and it was seen to abort a rank that had finished
    # ("terminate called without an active exception", exit -6) about once in several whole-suite runs.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this rank when the process that launched it is gone (killed, not only ended): no orphan goes on training."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="sdcguard-parent-watch", daemon=True).start()


WORLD_INDEX_ENV = "SDCGUARD_WORLD_INDEX"
"""Set by ``launch(..., worlds=N)`` in every rank: which of the N process groups it belongs to (0 .. N-1)."""


def launch(nproc: int, fn: Callable[..., Any], args: Sequence[Any] = (), env: Mapping[str, str] | None = None,
           timeout: float | None = None, start_method: str = "spawn", worlds: int = 1) -> list[int | None]:
    """Run ``fn(*args)`` in ``nproc`` spawned processes with torchrun's variables set; their exit codes.

    ``env`` adds variables (per-rank ones may be given as ``NAME@RANK``).
    ``worlds`` > 1 starts that many independent process groups of ``nproc``
    ranks at once, each with its own rendezvous, ``WORLD_INDEX_ENV`` telling a
    rank its group; the exit codes are listed group after group.
    A process still running after ``timeout`` seconds, or ``FAILED_RANK_GRACE_S``
    after another rank failed, is terminated (exit code None is reported for
    it); so is every rank when the caller is interrupted, and a rank whose
    launching process is killed ends itself.

    ``start_method="fork"`` saves every rank its imports (seconds each on a
    small machine), but only a process that has started no threads and run no
    torch operation may fork: a launcher that has only imported what the ranks
    need. Raises ``ValueError`` for another start method.
    """
    if start_method not in ("spawn", "fork"):
        raise ValueError(f"start_method: must be spawn or fork, got {start_method!r}")
    if worlds < 1:
        raise ValueError(f"worlds: must be >= 1, got {worlds}")
    ctx = multiprocessing.get_context("fork") if start_method == "fork" else multiprocessing.get_context("spawn")
    extra = dict(env or {})
    procs = []
    for index, port in enumerate(free_ports(worlds)):
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), WORLD_INDEX_ENV: str(index)}
        for rank in range(nproc):
            child_env = {**base, **{k: v for k, v in extra.items() if "@" not in k}}
            child_env.update({k.split("@")[0]: v for k, v in extra.items() if k.endswith(f"@{rank}")})
            p = ctx.Process(target=_child, args=(fn, rank, child_env, tuple(args)), daemon=False)
            p.start()
            procs.append(p)
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at: float | None = None
    try:
        while alive := [p for p in procs if p.is_alive()]:
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now  # the others may wait for the failed rank in a collective until gloo's timeout
            if (deadline is not None and now >= deadline) or (failed_at is not None
                                                               and now - failed_at > FAILED_RANK_GRACE_S):
                break
            alive[0].join(0.2)  # it may have ended since: join returns at once
    finally:
        # Whatever ended the wait (all done, the time limit, a failed rank, Ctrl-C): leave no rank running.
        stopped = {i for i, p in enumerate(procs) if p.is_alive()}
        for i in stopped:
            procs[i].terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [None if i in stopped else p.exitcode for i, p in enumerate(procs)]


# -- the command line --------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The reference job's arguments."""
    p = argparse.ArgumentParser(prog="python -m sdcguard.agent.testing.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--audit-every", type=int, default=None, help="ring audit cadence (default: GuardConfig's 100)")
    p.add_argument("--fingerprint-every", type=int, default=None,
                   help="weight fingerprint cadence (default: GuardConfig's 10)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="simulate nodes of this many ranks")
    p.add_argument("--checkpoint-prefix", default=None, help="s3://bucket/prefix or a folder for checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--on-alarm", choices=["stop", "raise", "continue"], default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the data and the replay")
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks (default: {MODEL_SHAPE_ENV}'s, else {JobShape.layers})")
    p.add_argument("--dim", type=int, default=None,
                   help=f"model width (default: {MODEL_SHAPE_ENV}'s, else {JobShape.dim})")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sharding", choices=SHARDINGS, default="ddp",
                   help="ddp (default), hsdp (FSDP2 on a replicate x shard mesh) or fsdp (FSDP2, 1-D mesh)")
    p.add_argument("--replicas", type=int, default=None,
                   help="with --sharding hsdp: replica groups (default: one per node)")
    p.add_argument("--nproc", type=int, default=0,
                   help="spawn this many local ranks (gloo) instead of running under torchrun")
    p.add_argument("--node-names", default="",
                   help="with --nproc: comma-separated NODE_NAME of each simulated node (node i holds ranks "
                        "i*ranks_per_node ...); the ranks of node i get POD_NAME/HOSTNAME <job>-worker-<i>, one pod "
                        "per node as in a PyTorchJob")
    return p


def _config(args: argparse.Namespace) -> GuardConfig:
    overrides = {k: v for k, v in {
        "audit_every": args.audit_every,
        "fingerprint_every": args.fingerprint_every,
        "ranks_per_node": args.ranks_per_node,
        "checkpoint_prefix": args.checkpoint_prefix,
        "on_alarm": args.on_alarm,
        "seed": args.seed,
    }.items() if v is not None}
    return GuardConfig.from_env(**overrides)


def _worker(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s rank%(process)d %(name)s: %(message)s")
    init_process_group()
    try:
        shape = _shape(args)
        summary = train(args.steps, shape, _config(args), checkpoint_every=args.checkpoint_every,
                        sharding=args.sharding, replicas=args.replicas)
        if summary["rank"] == 0:
            print(json.dumps(summary), flush=True)
    except SystemExit:
        # on_alarm="stop": skip the teardown collectives (the other ranks are stopping too).
        raise
    shutdown()


def _shape(args: argparse.Namespace) -> JobShape:
    """The job's shape: ``MODEL_SHAPE_ENV``'s sizes, then the flags (ValueError naming the variable)."""
    sizes = {k: v for k, v in {"dim": args.dim, "layers": args.layers}.items() if v is not None}
    return replace(model_shape(), **sizes, batch=args.batch, seed=args.seed)


def _node_env(args: argparse.Namespace) -> dict[str, str]:
    """Per-rank NODE_NAME/POD_NAME/HOSTNAME for ``--node-names`` (ValueError naming the flag if they do not fit)."""
    names = [n.strip() for n in args.node_names.split(",") if n.strip()]
    if not names:
        return {}
    per_node = args.ranks_per_node or args.nproc
    if per_node * len(names) != args.nproc:
        raise ValueError(f"--node-names: {len(names)} node(s) x {per_node} rank(s) per node is not --nproc {args.nproc}")
    job = _config(args).job_name
    env = {}
    for rank in range(args.nproc):
        env[f"NODE_NAME@{rank}"] = names[rank // per_node]
        # One pod per node, as a PyTorchJob runs torchrun in each (and `sdcguard local seed` names them).
        env[f"POD_NAME@{rank}"] = env[f"HOSTNAME@{rank}"] = f"{job}-worker-{rank // per_node}"
    return env


def _check(args: argparse.Namespace) -> None:
    """Refuse bad flags and settings before any rank starts: ValueError naming the flag or the variable."""
    for flag in ("steps", "checkpoint_every"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 0, got {getattr(args, flag)}")
    _config(args)
    _shape(args)
    try:
        inject.from_env()
    except ValueError as exc:
        raise ValueError(f"{inject.ENV_VAR}: {exc}") from None
    native.mode()
    native.isa_limit()


RANK_IMPORTS = {"ddp": ("torch._dynamo",),
                "hsdp": ("torch._dynamo", "torch.distributed.checkpoint", "sdcguard.agent.sharded", "sdcguard.agent.sharded_checkpoint")}


def _start_method(sharding: str) -> str:
    """``--nproc`` forks on Linux once what every rank needs is imported (a spawned rank imports it again:
    seconds of CPU per rank on a small machine; DDP's and FSDP's constructors import torch._dynamo); it spawns
    elsewhere. This process has run no torch operation and started no thread, so it may fork."""
    if sys.platform != "linux":
        return "spawn"
    for module in RANK_IMPORTS.get(sharding, RANK_IMPORTS["hsdp"]):
        importlib.import_module(module)
    return "fork"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the reference job; returns the exit status (see the module docstring)."""
    args = parser().parse_args(argv)
    try:
        _check(args)
    except ValueError as exc:
        print(f"sdcguard.agent.testing.train: error: {exc}", file=sys.stderr)
        return 2
    # What the ranks train is what a capsule's factory (replay_model) rebuilds, here and in a replay Job.
    spec = shape_spec(_shape(args))
    if spec:
        os.environ[MODEL_SHAPE_ENV] = spec
    else:
        os.environ.pop(MODEL_SHAPE_ENV, None)
    if args.nproc:
        try:
            env = _node_env(args)
        except ValueError as exc:
            print(f"sdcguard.agent.testing.train: error: {exc}", file=sys.stderr)
            return 2
        codes = launch(args.nproc, _worker, (args,), env=env, start_method=_start_method(args.sharding))
        return max((c if c is not None else 1) for c in codes)
    _worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
