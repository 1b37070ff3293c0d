"""Where this rank sits: its ranks, its node, and its neighbours on the audit ring."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """One rank's place in the job, and the names that locate its hardware."""

    rank: int
    local_rank: int
    world_size: int
    ranks_per_node: int
    node: str
    """Kubernetes node name (downward API ``NODE_NAME``), or ``node-<index>`` when unset."""
    pod: str
    """Pod name (``POD_NAME``, else the host name: a pod's host name is its name)."""
    host: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: {self.rank} is outside the world of {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node: {self.ranks_per_node} does not divide world_size {self.world_size}")
        if not 0 <= self.local_rank < self.ranks_per_node:
            raise ValueError(f"local_rank: {self.local_rank} is not below ranks_per_node {self.ranks_per_node}")

    @property
    def nodes(self) -> int:
        """How many nodes the world spans."""
        return self.world_size // self.ranks_per_node

    @property
    def node_index(self) -> int:
        """This rank's node, counted from 0 (ranks are laid out node by node, as torchrun does)."""
        return node_of(self.rank, self.ranks_per_node)

    @property
    def audits(self) -> int:
        """The rank whose micro-batch this rank recomputes: the same local rank on the next node."""
        return audited_by_ring(self.rank, self.world_size, self.ranks_per_node)

    @property
    def audited_by(self) -> int:
        """The rank that recomputes this rank's micro-batch: the same local rank on the previous node."""
        return (self.rank - self.ranks_per_node) % self.world_size

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        ranks_per_node: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> Topology:
        """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_NAME, POD_NAME, HOSTNAME.

        ``ranks_per_node`` overrides LOCAL_WORLD_SIZE and then LOCAL_RANK is
        derived from the rank, which simulates several nodes on one machine.
        Raises ``ValueError`` naming the variable that is missing or wrong.
        """
        env = os.environ if env is None else env
        rank = _int(env, "RANK", 0) if rank is None else rank
        world_size = _int(env, "WORLD_SIZE", 1) if world_size is None else world_size
        if ranks_per_node is None:
            ranks_per_node = _int(env, "LOCAL_WORLD_SIZE", 1)
            local_rank = _int(env, "LOCAL_RANK", rank % ranks_per_node)
        else:
            local_rank = rank % ranks_per_node
        host = env.get("HOSTNAME") or socket.gethostname()
        node = env.get("NODE_NAME") or f"node-{node_of(rank, ranks_per_node)}"
        return cls(rank=rank, local_rank=local_rank, world_size=world_size, ranks_per_node=ranks_per_node,
                   node=node, pod=env.get("POD_NAME") or host, host=host)


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node index of ``rank``."""
    return rank // ranks_per_node


def audited_by_ring(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank that ``rank`` audits: ``(rank + ranks_per_node) mod world``."""
    return (rank + ranks_per_node) % world_size


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
