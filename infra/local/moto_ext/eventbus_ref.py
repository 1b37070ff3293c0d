"""Gap: ``Ref`` of an ``AWS::Events::EventBus`` fails on moto (the model has no physical id).

CloudFormation's ``Ref`` of a bus is its name. Hook: ``EventBus.physical_resource_id``.
"""

from __future__ import annotations

from moto.events.models import EventBus


def _bus_name(self: EventBus) -> str:
    return self.name


def install() -> None:
    """Make ``Ref`` of an event bus give its name."""
    EventBus.physical_resource_id = property(_bus_name)  # type: ignore[attr-defined]
