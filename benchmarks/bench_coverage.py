"""``./dev bench coverage [--quick] [--out DIR] [--replay ROW-ID]``: the fault-injection campaign (the campaign package)."""

from __future__ import annotations

from sdcguard.campaign import main

WHOLE_SET_ARGS = ["--quick"]
"""A plain ``./dev bench`` (every benchmark) runs the quick campaign; the full one (~30 min) only when named."""

__all__ = ["WHOLE_SET_ARGS", "main"]
