"""Run an example loop as a small multi-node job on one machine: spawned processes with torchrun's variables.

``--spawn 3x2`` in either example starts 3 simulated nodes of 2 ranks (gloo,
on the CPU): each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as
``torchrun --nnodes 3 --nproc-per-node 2`` would give it on each node.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from typing import Any


def parse_spawn(text: str) -> tuple[int, int]:
    """``"NODESxRANKS"`` -> (nodes, ranks per node); ValueError for anything else."""
    nodes, _, ranks = text.lower().partition("x")
    try:
        shape = int(nodes), int(ranks)
    except ValueError:
        raise ValueError(f"--spawn: expected NODESxRANKS such as 3x2, got {text!r}") from None
    if min(shape) < 1:
        raise ValueError(f"--spawn: nodes and ranks must be >= 1, got {text!r}")
    return shape


def spawn(nodes: int, ranks_per_node: int, fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` in ``nodes * ranks_per_node`` processes; the highest exit code (0 when all succeeded)."""
    world = nodes * ranks_per_node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # As torchrun does: one intra-op thread per process unless told otherwise (set before the children import torch).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(world):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               "RANK": str(rank), "LOCAL_RANK": str(rank % ranks_per_node),
               "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(rank // ranks_per_node)}
        proc = ctx.Process(target=_child, args=(env, fn, args))
        proc.start()
        procs.append(proc)
    for proc in procs:
        proc.join()
    return max(abs(p.exitcode or 0) for p in procs)


def _child(env: dict[str, str], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(env)
    fn(*args)
