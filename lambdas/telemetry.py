"""The handlers' powertools: one Logger, Tracer and Metrics (EMF) for the code package.

Service name and metrics namespace come from POWERTOOLS_SERVICE_NAME and
POWERTOOLS_METRICS_NAMESPACE; these objects create no AWS client.
"""

from __future__ import annotations

import os

from aws_lambda_powertools import Logger, Metrics, Tracer

SERVICE = os.environ.get("POWERTOOLS_SERVICE_NAME", "sdcguard")
NAMESPACE = os.environ.get("POWERTOOLS_METRICS_NAMESPACE", "sdcguard")

logger = Logger(service=SERVICE)
tracer = Tracer(service=SERVICE)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)
