"""The in-job agent: ``from sdcguard.agent import SDCGuard, GuardConfig``.

The guard (and torch.distributed behind it) is imported on first use, so that
``import sdcguard.agent.fingerprint`` or ``sdcguard.agent.config`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sdcguard.agent.config import ALARM_EXIT_CODE, GuardConfig

if TYPE_CHECKING:
    from sdcguard.agent.guard import DataFaultLimit, GuardAlarm, NonReproducible, SDCGuard, StepResult

_LAZY = {"DataFaultLimit", "GuardAlarm", "NonReproducible", "SDCGuard", "StepResult"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from sdcguard.agent import guard

        return getattr(guard, name)
    raise AttributeError(f"module 'sdcguard.agent' has no attribute {name!r}")


__all__ = ["ALARM_EXIT_CODE", "DataFaultLimit", "GuardAlarm", "GuardConfig", "NonReproducible", "SDCGuard",
           "StepResult"]
