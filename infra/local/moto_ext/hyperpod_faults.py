"""Gap: moto's SageMaker never fails transiently; the chaos drill needs HyperPod calls that do, as AWS's do.

``chaos`` (an :class:`sdcguard.infra.local.eks.faults.Chaos`, off by default) fails a
fraction of the SageMaker HyperPod calls (the SageMaker operations on
clusters: ``ListClusterNodes``, ``BatchReplaceClusterNodes``, ...) before
moto handles them, so a failed call changes nothing. Each fault answers as
SageMaker does when it is throttled or unwell:

- 429 -> HTTP 400 ``ThrottlingException`` (SageMaker throttles with a 400),
- 500 -> HTTP 500 ``InternalFailure``,
- 503 -> HTTP 503 ``ServiceUnavailable``;

botocore's retry modes retry all three. The chaos operation is the action
name; the call is the action and its request body, so a resend of the same
request (botocore's, or a Lambda invocation retried by the state machine)
counts as the retry that absorbed the fault.

Hook: ``SageMakerResponse.call_action``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from moto.sagemaker.responses import SageMakerResponse

from sdcguard.infra.local.eks.faults import Chaos

ERRORS: dict[int, tuple[int, str, str]] = {
    429: (400, "ThrottlingException", "Rate exceeded"),
    500: (500, "InternalFailure", "The request processing has failed because of an unknown error."),
    503: (503, "ServiceUnavailable", "The service is unavailable. Please try again later."),
}
"""Chaos status -> (HTTP status, error code, message) SageMaker answers with."""

chaos = Chaos()
"""The HyperPod calls' chaos knob: ``chaos.set(0.2, seed=7)``, ``chaos.tally()``, ``chaos.off()``."""

_original_call_action = SageMakerResponse.call_action


def is_hyperpod_call(action: str) -> bool:
    """Whether a SageMaker action is a HyperPod call (an operation on clusters or their nodes)."""
    return "Cluster" in action


def call_action(self: SageMakerResponse) -> Any:
    """Fail a HyperPod call when chaos says so, before moto touches anything; otherwise moto's own."""
    action = self._get_action()
    if action and is_hyperpod_call(action):
        body = self.body if isinstance(self.body, bytes) else str(self.body or "").encode()
        status = chaos.decide(action, hashlib.sha256(body).hexdigest())
        if status is not None:
            http_status, code, message = ERRORS.get(status, (status, "InternalFailure", ERRORS[500][2]))
            headers = {
                "status": str(http_status),
                "Content-Type": "application/x-amz-json-1.1",
                "X-Amzn-ErrorType": code,
            }
            return http_status, headers, json.dumps({"__type": code, "message": message})
    return _original_call_action(self)


def install() -> None:
    """Route SageMaker's actions through the chaos knob."""
    SageMakerResponse.call_action = call_action  # type: ignore[method-assign,assignment]
