"""Stored sample events (EventBridge envelopes whose ``detail`` is an alarm)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EVENTS_DIR = Path(__file__).parent


def load_event(name: str) -> dict[str, Any]:
    """The stored event ``tests/events/<name>.json``."""
    data: dict[str, Any] = json.loads((EVENTS_DIR / f"{name}.json").read_text())
    return data


def event_names() -> list[str]:
    """Names of every stored event."""
    return sorted(p.stem for p in EVENTS_DIR.glob("*.json"))
