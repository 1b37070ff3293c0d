"""The in-job agent: ``from agent import SDCGuard, GuardConfig``.

The guard (and torch.distributed behind it) is imported on first use, so that
``import agent.fingerprint`` or ``agent.config`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.config import ALARM_EXIT_CODE, GuardConfig

if TYPE_CHECKING:
    from agent.guard import DataFaultLimit, GuardAlarm, NonReproducible, SDCGuard, StepResult

_LAZY = {"DataFaultLimit", "GuardAlarm", "NonReproducible", "SDCGuard", "StepResult"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from agent import guard

        return getattr(guard, name)
    raise AttributeError(f"module 'agent' has no attribute {name!r}")


__all__ = ["ALARM_EXIT_CODE", "DataFaultLimit", "GuardAlarm", "GuardConfig", "NonReproducible", "SDCGuard",
           "StepResult"]
