"""What the ranks of one world agree on: every rank's row of figures, a flag true on all, rank 0's choice.

Each call is a collective: every rank of the world makes the same calls in
the same order, or the world hangs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankGroup:
    """This rank's view of its world (process group), on the device its collectives run on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values``, by rank (float64 on the way: integers up to 2**53 stay exact)."""
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(out, local)
        return [t.cpu().tolist() for t in out]

    def all(self, flag: bool) -> bool:
        """Whether ``flag`` is true on every rank."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank."""
        return not self.all(not flag)

    def from_rank0(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (the others' are ignored)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())
