"""The disagreement path's recomputations on other nodes: confirming the suspicious micro-batches, replaying the
suspects. Collectives (every rank calls them alike); sdcguard.agent.confirm judges what they gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sdcguard.agent.confirm import (
    REPLAY_SLOTS,
    ReplayVerdict,
    Ring,
    judge_confirmations,
    judge_replays,
    replay_plan,
    witness_plan,
)
from sdcguard.agent.decide import Confirmation
from sdcguard.agent.parallelism import Parallelism

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's ``[n]`` tensor as ``[world, n]`` on the CPU (a collective)."""


class Recomputations:
    """This rank's share of the confirmations and the replays, over ``parallel``'s recomputation."""

    def __init__(self, parallel: Parallelism, ring: Ring, rank: int, gather: Gather) -> None:
        self.parallel = parallel
        self.ring = ring
        self.rank = rank
        self.gather = gather

    def claims(self, step: int, assigned: dict[int, int], width: int, slots: int, *, digests: bool) -> torch.Tensor:
        """``[slots, 1 + width]``: per slot, 1 and the claim of the owner this rank recomputes there, or zeros.

        Where a recomputation is a collective (FSDP2), every rank runs every slot in lock step, its own
        micro-batch where it has no owner (the result unused)."""
        parallel, device = self.parallel, self.parallel.device
        rows = [torch.zeros(1 + width, dtype=torch.int64, device=device) for _ in range(slots)]
        for slot in range(slots):
            owner = assigned.get(slot)
            if owner is None and not parallel.collective_recompute:
                continue
            claim = parallel.recompute_claim(step, self.rank if owner is None else owner, digests=digests)
            if owner is not None:
                # "Recomputed" (1), then the claim; made on the device.
                rows[slot] = torch.cat([torch.ones(1, dtype=torch.int64, device=device), claim.to(device)])
        return torch.stack(rows)

    def confirm(self, step: int, claims: torch.Tensor, owners: dict[int, tuple[str, ...]],
                *, digests: bool) -> Confirmation:
        """Recompute each owner's micro-batch on its confirmers (this rank does at most two), gather, judge."""
        assigned = dict(self.ring.assignments(self.rank, set(owners)))
        # Every owner's previous unit recomputes it in slot 0; with 3 or more units the next one in slot 1.
        slots = 2 if self.ring.units >= 3 else 1
        recomputed = self.claims(step, assigned, claims.shape[1], slots, digests=digests)
        if slots < 2:  # every rank sends two slots (the gathered layout), the second empty
            recomputed = torch.cat([recomputed, torch.zeros_like(recomputed)])
        records = self.gather(recomputed.reshape(-1)).reshape(-1, 2, 1 + claims.shape[1])
        verdict = judge_confirmations(claims, records, owners, self.ring)
        return Confirmation(verdict, claims, records)

    def replays(self, step: int, c: Confirmation, *, digests: bool) -> ReplayVerdict:
        """Each localised suspect replays once the micro-batch it got wrong, and each outcome's witness (a rank
        of its majority) its own result, in one collective (under FSDP2 every other rank replays its own in lock
        step, the result unused); their verdict."""
        plan = replay_plan(c.verdict)
        if not plan:
            return ReplayVerdict("unknown")
        rank, width = self.rank, c.claims.shape[1]
        witnesses = witness_plan(plan)
        assigned = {slot: roles[rank].owner for slot, roles in enumerate((plan, witnesses)) if rank in roles}
        replayed = self.claims(step, assigned, width, REPLAY_SLOTS, digests=digests)
        gathered = self.gather(replayed.reshape(-1)).reshape(-1, REPLAY_SLOTS, 1 + width)
        return judge_replays(gathered, plan, c.claims, c.records, self.ring)
