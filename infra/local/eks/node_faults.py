"""Node hardware faults: the stand-in's simulated faulty GPUs, by node.

A real faulty GPU corrupts whatever runs on its node. On the stand-in, a
node's fault is an ``SDCGUARD_INJECT`` spec (see ``sdcguard.agent.testing.inject``) that the
Job runner hands to every process it starts on that node, so a replay of a
capsule there computes wrong bits exactly as the training ranks did.

``replacements_inherit`` makes the node HyperPod brings up to replace a
faulty one faulty too (its spec's ``node=`` rewritten to the new node): the
case of a replacement drawn from the same bad batch of hardware. Set it over
HTTP with ``PUT /_standin/node-faults``::

    {"faults": {"hyperpod-i-0123...": "kind=finite_activation,node=hyperpod-i-0123...,step=3,repeat=50"},
     "replacements_inherit": true}

The specs are checked for shape here (comma-separated ``key=value`` with a
``kind`` and a ``step``); ``sdcguard.agent.testing.inject`` checks the rest when the process
starts, and a process given a bad spec exits with its message.
"""

from __future__ import annotations

import threading
from typing import Any

_KEYS = ("kind", "step", "rank", "node", "factor", "bit", "repeat", "param")


class BadNodeFault(ValueError):
    """A node fault spec or body that is not of the expected shape (the message says what)."""


def _fields(spec: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _KEYS:
            raise BadNodeFault(f"{part!r} is not one of {', '.join(_KEYS)} = value")
        pairs.append((key.strip(), value.strip()))
    keys = {k for k, _ in pairs}
    if not {"kind", "step"} <= keys:
        raise BadNodeFault(f"{spec!r} needs kind= and step=")
    return pairs


def rebound(spec: str, node: str) -> str:
    """``spec`` with its ``node=`` set to ``node`` (a rank-bound spec is returned as it is). Raises BadNodeFault."""
    pairs = _fields(spec)
    if not any(k == "node" for k, _ in pairs):
        return spec
    return ",".join(f"{k}={node if k == 'node' else v}" for k, v in pairs)


class NodeFaults:
    """The registered faults by node name, and whether replacements inherit them; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: dict[str, str] = {}
        self.replacements_inherit = False

    def set(self, faults: dict[str, str], *, replacements_inherit: bool = False) -> None:
        """Replace every registered fault (an empty dict heals every node). Raises BadNodeFault for a bad spec."""
        checked = {}
        for node, spec in faults.items():
            if not isinstance(node, str) or not node or not isinstance(spec, str):
                raise BadNodeFault(f"faults: {node!r}: {spec!r} is not node name: spec string")
            _fields(spec)
            checked[node] = spec
        with self._lock:
            self._faults = checked
            self.replacements_inherit = bool(replacements_inherit)

    def add(self, node: str, spec: str) -> None:
        """Register (or replace) one node's fault. Raises BadNodeFault for a bad spec."""
        _fields(spec)
        with self._lock:
            self._faults[node] = spec

    def clear(self) -> None:
        """Heal every node; replacements no longer inherit."""
        self.set({})

    def for_node(self, node: str) -> str | None:
        """The spec a process on ``node`` gets as ``SDCGUARD_INJECT``, or None for a healthy node."""
        with self._lock:
            return self._faults.get(node)

    def replaced(self, old: str, new: str) -> str | None:
        """Node ``new`` replaced ``old``: with ``replacements_inherit`` and a faulty ``old``, ``new`` gets its
        fault (``node=`` rewritten), which is returned; None otherwise."""
        with self._lock:
            spec = self._faults.get(old)
            if not self.replacements_inherit or spec is None:
                return None
            inherited = rebound(spec, new)
            self._faults[new] = inherited
            return inherited

    def to_dict(self) -> dict[str, Any]:
        """The body of ``GET /_standin/node-faults``."""
        with self._lock:
            return {"faults": dict(self._faults), "replacements_inherit": self.replacements_inherit}

    def apply(self, body: Any) -> None:
        """Apply a ``PUT /_standin/node-faults`` body (replaces everything). Raises BadNodeFault."""
        if not isinstance(body, dict) or not set(body) <= {"faults", "replacements_inherit"}:
            raise BadNodeFault('the body must be {"faults": {node: spec}, "replacements_inherit": bool}')
        faults = body.get("faults") or {}
        inherit = body.get("replacements_inherit", False)
        if not isinstance(faults, dict) or not isinstance(inherit, bool):
            raise BadNodeFault('the body must be {"faults": {node: spec}, "replacements_inherit": bool}')
        self.set(faults, replacements_inherit=inherit)
