"""The faults shared by several worlds: each world takes, in plan order, the next fault no world has taken.

A claim is a file named for the fault's place in the plan, created with
``O_EXCL`` by rank 0 of the claiming world: the file system decides, so two
worlds never run the same fault and no fault is left out, with no process
that hands out work. Rank 0 then tells its world which fault it took (a
collective), so every rank of a world runs the same faults.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from sdcguard.campaign.collectives import RankGroup
from sdcguard.campaign.faults import FaultSpec


class FaultQueue:
    """The plan's faults, claimed through files in ``claims`` (one folder shared by every world)."""

    def __init__(self, faults: list[FaultSpec], claims: Path, group: RankGroup) -> None:
        self.faults = faults
        self.claims = claims
        self.group = group

    def _claim_after(self, index: int) -> int:
        """(rank 0) The place of the first fault after ``index`` that no world has claimed, now claimed; -1
        when every one is taken."""
        for i in range(index + 1, len(self.faults)):
            try:
                os.close(os.open(self.claims / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            return i
        return -1

    def claimed(self) -> Iterator[tuple[int, FaultSpec]]:
        """The faults this world runs, with their place in the plan, in plan order (collective)."""
        index = -1
        while True:
            index = self.group.from_rank0(self._claim_after(index) if self.group.rank == 0 else -1)
            if index < 0:
                return
            yield index, self.faults[index]
