"""The clean run, kept at the start of every step: snapshots to start another run from, flat copies to compare
another run's state with, and the magnitude trigger's history.

Every faulted run starts a few steps before its fault from the clean run's
state there (training before the fault is the clean run), and ends compared
bit for bit with the clean run's state at the same step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch


def flat_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(all weights, all weights, buffers and optimizer state) as flat fp32 copies, in a fixed order."""
    params = [p.detach().reshape(-1) for p in module.parameters()]
    state: list[torch.Tensor] = [b.detach().reshape(-1).float() for b in module.buffers()]
    for p in module.parameters():
        for key in sorted(optimizer.state.get(p, {})):
            value = optimizer.state[p][key]
            if isinstance(value, torch.Tensor):
                state.append(value.detach().reshape(-1).float())
    weights = torch.cat(params)
    return weights.clone(), torch.cat([weights, *state])


@dataclass
class Snapshot:
    """A model's and its optimizer's state, copied, to put back into another instance of the same job."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    optimizer: dict[str, Any]

    @classmethod
    def of(cls, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Snapshot:
        """A copy of ``module``'s and ``optimizer``'s state now."""
        return cls([p.detach().clone() for p in module.parameters()],
                   [b.detach().clone() for b in module.buffers()], copy.deepcopy(optimizer.state_dict()))

    def restore(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Put the state back into ``module`` and ``optimizer`` (built as the snapshot's were)."""
        with torch.no_grad():
            for t, saved in zip([*module.parameters(), *module.buffers()], [*self.params, *self.buffers],
                                strict=True):
                t.copy_(saved)
        # load_state_dict keeps same-device tensors as they are: hand it copies.
        optimizer.load_state_dict(copy.deepcopy(self.optimizer))


TriggerState = tuple[torch.Tensor, int]
"""What ``trigger.state()`` returns and ``trigger.load_state`` takes."""


@dataclass
class CleanTrajectory:
    """The clean run's state at the start of every step it trained (and after its last)."""

    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    """All weights, flat, per step."""
    state: dict[int, torch.Tensor] = field(default_factory=dict)
    """All weights, buffers and optimizer state, flat, per step: the bit-for-bit comparison's reference."""
    trigger: dict[str, dict[int, TriggerState]] = field(default_factory=dict)
    """Per configuration with the magnitude trigger: its history at the start of every clean step."""

    def keep(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Keep the state at the start of ``step``."""
        self.snapshots[step] = Snapshot.of(module, optimizer)
        self.weights[step], self.state[step] = flat_state(module, optimizer)

    def matches(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this rank's state is bit-identical to the clean run's at the start of ``step``."""
        return torch.equal(flat_state(module, optimizer)[1], self.state[step])
