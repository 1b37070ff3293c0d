"""How a drill fails: :class:`DrillFailed`, naming the step and carrying what was learned before it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sdcguard.infra.drill.summary import DrillSummary


class DrillFailed(RuntimeError):
    """A step of the drill failed; ``step`` names it and ``summary`` holds what was learned before."""

    def __init__(self, step: str, message: str, summary: DrillSummary | None = None) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.summary = summary
