"""What the parent hands every rank: the settings, the detector configurations, the phases and the faults.

Written once by the parent as ``plan.json`` (kept beside the report: the
campaign's inputs), read by every rank of every world.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sdcguard.campaign.faults import FaultSpec
from sdcguard.campaign.settings import Settings

Phase = Literal["clean", "faults", "soak"]
"""``clean``: every configuration on the clean run (the first world); ``faults``: every fault (all worlds);
``soak``: the clean soak (the last world)."""


@dataclass(frozen=True)
class RankPlan:
    """One campaign as its ranks see it."""

    settings: Settings
    configs: dict[str, dict[str, Any]]
    """Row name -> GuardConfig overrides (``detectors.configs``)."""
    fault_configs: list[str]
    """The rows a fault runs under, besides ``none`` (the run without detectors)."""
    phases: list[Phase]
    worlds: int
    """Process groups sharing the faults."""
    derive: bool
    """Skip a detector's run where the run without detectors proves it silent."""
    faults: list[FaultSpec]
    out: str
    """The work folder: the plan, the claims, each world's records and scratch space."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the settings with the derived ``last_step``)."""
        return {"settings": {**dataclasses.asdict(self.settings), "last_step": self.settings.last_step},
                "configs": self.configs, "fault_configs": self.fault_configs, "phases": self.phases,
                "worlds": self.worlds, "derive": self.derive, "faults": [f.to_dict() for f in self.faults],
                "out": self.out}

    @classmethod
    def read(cls, path: str | Path) -> RankPlan:
        """The plan ``to_dict`` wrote as JSON to ``path``."""
        doc = json.loads(Path(path).read_text())
        settings = {k: v for k, v in doc["settings"].items() if k != "last_step"}
        return cls(settings=Settings(**{**settings, "models": tuple(settings["models"])}), configs=doc["configs"],
                   fault_configs=doc["fault_configs"], phases=doc["phases"], worlds=int(doc.get("worlds", 1)),
                   derive=bool(doc.get("derive")), faults=[FaultSpec.from_dict(f) for f in doc["faults"]],
                   out=doc["out"])
