"""A publisher that keeps the alarms it is asked to publish (the tests' ranks have no event bus)."""

from __future__ import annotations

from sdcguard.agent.config import GuardConfig
from sdcguard.agent.publisher import Publisher, PublishOutcome
from sdcguard.contract import Alarm


class Outbox(Publisher):
    """Keeps every alarm in ``sent`` instead of sending it, and republishes nothing spooled."""

    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config)
        self.sent: list[Alarm] = []

    def publish(self, alarm: Alarm) -> PublishOutcome:
        self.sent.append(alarm)
        return PublishOutcome(delivered=True, event_id="recorded")

    def republish_spooled(self, *, local: bool = True, s3: bool = True) -> dict[str, PublishOutcome]:
        return {}
