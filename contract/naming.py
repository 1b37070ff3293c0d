"""The node-name rule: HyperPod names each EKS worker node ``hyperpod-<EC2 instance id>``.

The one home of the rule; the pipeline reads instance ids out of node names
with it, and the local stand-in and the drill build node names with it.
"""

from __future__ import annotations

import re

NODE_PREFIX = "hyperpod-"
INSTANCE_ID = re.compile(r"^i-[0-9a-f]{17}$")
"""An EC2 instance id as issued today: ``i-`` and 17 lowercase hex digits."""
_NODE_NAME = re.compile(rf"^{NODE_PREFIX}(i-[0-9a-f]{{8,17}})$")
"""A HyperPod node name; it also accepts the older 8-digit instance ids."""


def node_name(instance_id: str) -> str:
    """The Kubernetes node name HyperPod gives an instance; raises ValueError for an id that is not ``i-`` + 17 hex."""
    if not INSTANCE_ID.match(instance_id):
        raise ValueError(f"instance id {instance_id!r} is not 'i-' followed by 17 lowercase hex digits")
    return NODE_PREFIX + instance_id


def instance_id_of(node: str) -> str | None:
    """The instance id in a HyperPod node name (``hyperpod-i-...``), or None when ``node`` is not one."""
    match = _NODE_NAME.match(node)
    return match.group(1) if match else None
