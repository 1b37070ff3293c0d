"""Kubernetes API failures mapped onto the pipeline's named errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from sdcguard.lambdas.errors import KubernetesObjectMissing, TransientKubernetesError


@contextlib.contextmanager
def kubernetes_errors(what: str) -> Iterator[None]:
    """Re-raise a retryable API failure as :class:`TransientKubernetesError` and a 404 as
    :class:`KubernetesObjectMissing`; anything else propagates unchanged."""
    try:
        yield
    except ApiException as exc:
        if exc.status == 404:
            raise KubernetesObjectMissing(f"{what}: not found") from None
        if exc.status in (409, 429) or (exc.status or 0) >= 500:
            raise TransientKubernetesError(f"{what}: HTTP {exc.status} {exc.reason}") from None
        raise
    except HTTPError as exc:
        raise TransientKubernetesError(f"{what}: {type(exc).__name__}: {exc}") from None
