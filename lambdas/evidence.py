"""Evidence: what CloudWatch knows about a suspect instance around the alarm.

The GPU metrics of Container Insights (temperature, power, utilisation,
memory) and whatever DCGM counters the cluster publishes (Xid, ECC, NVLink
CRC, remapped rows), plus this instance's alarm history in the ledger.

Where and when are the pipeline's, not the alarm's: metrics are read from
the configured namespaces only (``DCGM_NAMESPACE``,
``CONTAINER_INSIGHTS_NAMESPACE``; anyone who may ``PutMetricData`` can
publish a metric of the same name under another), and the window is placed
by the incident's record time in the ledger (``created_at``), the alarm's
own ``time`` only moving it earlier, by at most :data:`BEFORE`. The
verdict is "corroborated" when the hardware itself or the history points at
the instance, else "no hardware signal" — which does not clear it: silent data
corruption is by definition invisible to the GPU's own counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, Final, Literal

import boto3
from pydantic import BaseModel

from sdcguard.contract import Incident, IncidentState
from sdcguard.lambdas.errors import IncidentNotWaiting
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.node_check import checks_of, reproduce_summary
from sdcguard.lambdas.settings import DEFAULT_CONTAINER_INSIGHTS_NAMESPACE, DEFAULT_DCGM_NAMESPACE

CORROBORATED: Final = "corroborated"
NO_HARDWARE_SIGNAL: Final = "no hardware signal"
HEALTHY_DCGM_NOTE = (
    "A healthy DCGM does not clear a node: silent data corruption leaves no ECC, Xid or "
    "throttle trace. The detector's evidence stands on its own."
)
BEFORE = timedelta(minutes=30)
AFTER = timedelta(minutes=5)
# Container Insights GPU metrics and the thermal limit above which a reading is notable.
GPU_TEMPERATURE_LIMIT_C = 87.0


class MetricSeries(BaseModel):
    """One metric's readings for one instance (a GPU or the node)."""

    name: str
    namespace: str = ""
    dimensions: dict[str, str]
    maximum: float | None
    points: int


class MetricSources(BaseModel):
    """Where the metrics were read from: the configured CloudWatch namespaces, nothing else."""

    dcgm_namespace: str
    container_insights_namespace: str

    @property
    def namespaces(self) -> list[str]:
        """Each namespace once."""
        return sorted({self.dcgm_namespace, self.container_insights_namespace})

    def describe(self) -> str:
        """One line for the evidence's reasons."""
        return (f"metrics read from CloudWatch namespace {self.dcgm_namespace!r} (DCGM counters) and "
                f"{self.container_insights_namespace!r} (Container Insights GPU metrics) only")


class InstanceEvidence(BaseModel):
    """The evidence summary for one instance."""

    instance_id: str
    verdict: Literal["corroborated", "no hardware signal"]
    reasons: list[str]
    note: str = HEALTHY_DCGM_NOTE
    metrics: list[MetricSeries] = []
    prior_incidents: list[str] = []
    window_start: datetime
    window_end: datetime
    namespaces: list[str] = []
    """The CloudWatch namespaces the metrics came from (:class:`MetricSources`)."""


def evidence_window(alarm_time: datetime, recorded_at: datetime) -> tuple[datetime, datetime]:
    """The metrics' window: from :data:`BEFORE` before the alarm's ``time`` to :data:`AFTER` after the incident
    was recorded, the alarm's time clamped into ``[recorded_at - BEFORE, recorded_at]``.

    The alarm's time is its publisher's word; the ledger's ``created_at`` is the pipeline's own. A time
    after the record (a clock ahead, or a lie) moves nothing later, and one long before it cannot send the
    window back to a quiet hour or an old Xid: the window never starts earlier than ``2 * BEFORE`` before the
    record and always covers the record itself."""
    anchor = min(max(alarm_time, recorded_at - BEFORE), recorded_at)
    return anchor - BEFORE, recorded_at + AFTER


def verdict_for(
    metrics: Iterable[MetricSeries], dcgm_counters: Iterable[str], prior_incidents: Iterable[str]
) -> tuple[Literal["corroborated", "no hardware signal"], list[str]]:
    """The verdict and the reasons behind it.

    Corroborated when a DCGM error counter is non-zero in the window, a GPU ran
    above its thermal limit, or the instance was a suspect of an earlier
    incident a reviewer approved (``prior_incidents``: see
    :func:`confirmed_incidents_of`; a rejected or forged alarm corroborates
    nothing). Otherwise "no hardware signal" (with the reason that none was found).
    """
    counters = set(dcgm_counters)
    reasons: list[str] = []
    for series in metrics:
        if series.maximum is None:
            continue
        gpu = series.dimensions.get("GpuDevice", "")
        where = f" on {gpu}" if gpu else ""
        if series.name in counters and series.maximum > 0:
            reasons.append(f"{series.name} reached {series.maximum:g}{where}")
        elif series.name == "node_gpu_temperature" and series.maximum > GPU_TEMPERATURE_LIMIT_C:
            reasons.append(f"GPU temperature reached {series.maximum:g} C{where} (limit {GPU_TEMPERATURE_LIMIT_C:g})")
    prior = sorted(set(prior_incidents))
    if prior:
        reasons.append(f"suspect in {len(prior)} earlier incident(s) a reviewer approved: {', '.join(prior)}")
    if reasons:
        return CORROBORATED, reasons
    return NO_HARDWARE_SIGNAL, ["no DCGM error counter, thermal excursion or earlier approved incident for this instance"]


def prior_incidents_of(instance_id: str, incidents: Iterable[Incident], *, exclude: str) -> list[str]:
    """Ids of other incidents that named ``instance_id`` as a suspect (the history the reviewers see)."""
    return sorted(
        i.incident_id for i in incidents if i.incident_id != exclude and instance_id in i.instance_ids
    )


def confirmed_incidents_of(instance_id: str, incidents: Iterable[Incident], *, exclude: str) -> list[str]:
    """Ids of other incidents on ``instance_id`` that a reviewer approved: the only history that corroborates.

    A rejected incident was judged a false alarm, and one that stopped before a
    decision (a forged alarm the cluster contradicted, a stale one) was never
    confirmed by anyone: counting those would let anyone who can put alarms on
    the bus manufacture "corroboration".
    """
    return sorted(
        i.incident_id
        for i in incidents
        if i.incident_id != exclude and instance_id in i.instance_ids and i.entered(IncidentState.APPROVED) is not None
    )


def instance_metrics(
    instance_id: str,
    start: datetime,
    end: datetime,
    *,
    namespaces: Iterable[str],
    metric_names: Iterable[str] | None = None,
    client: Any = None,
) -> list[MetricSeries]:
    """Every CloudWatch metric of ``namespaces`` carrying ``InstanceId=instance_id`` between ``start`` and ``end``.

    The dimension sets (per GPU, per node) are discovered with ListMetrics, one
    listing per namespace, so whichever GPU metrics the cluster publishes there
    are read and no other namespace's. ``metric_names`` limits the result (None: all).
    """
    client = client or boto3.client("cloudwatch")
    wanted = set(metric_names) if metric_names is not None else None
    # One query per distinct metric (moto's ListMetrics repeats them).
    unique: dict[tuple[str, str, tuple[tuple[str, str], ...]], dict[str, Any]] = {}
    for namespace in sorted(set(namespaces)):
        for page in client.get_paginator("list_metrics").paginate(
            Namespace=namespace, Dimensions=[{"Name": "InstanceId", "Value": instance_id}]
        ):
            for metric in page.get("Metrics", []):
                # Asked of the listing too: a metric is counted only from the namespace it was asked for.
                if metric["Namespace"] == namespace and (wanted is None or metric["MetricName"] in wanted):
                    dims = tuple(sorted((d["Name"], d["Value"]) for d in metric.get("Dimensions", [])))
                    unique.setdefault((metric["Namespace"], metric["MetricName"], dims), metric)
    found = list(unique.values())[:500]  # GetMetricData takes 500 queries per call
    if not found:
        return []
    queries = [
        {
            "Id": f"m{i}",
            "MetricStat": {
                "Metric": {"Namespace": m["Namespace"], "MetricName": m["MetricName"], "Dimensions": m.get("Dimensions", [])},
                "Period": 60,
                "Stat": "Maximum",
            },
            "ReturnData": True,
        }
        for i, m in enumerate(found)
    ]
    values: dict[str, list[float]] = {}
    for page in client.get_paginator("get_metric_data").paginate(
        MetricDataQueries=queries, StartTime=start, EndTime=end
    ):
        for result in page.get("MetricDataResults", []):
            values.setdefault(result["Id"], []).extend(result.get("Values", []))
    out = []
    for i, m in enumerate(found):
        readings = values.get(f"m{i}", [])
        out.append(
            MetricSeries(
                name=m["MetricName"],
                namespace=m["Namespace"],
                dimensions={d["Name"]: d["Value"] for d in m.get("Dimensions", [])},
                maximum=max(readings) if readings else None,
                points=len(readings),
            )
        )
    return sorted(out, key=lambda s: (s.name, sorted(s.dimensions.items())))


def from_namespaces(metrics: Iterable[MetricSeries], counters: Iterable[str], sources: MetricSources) -> list[MetricSeries]:
    """``metrics`` that count for the verdict: DCGM counters from the DCGM namespace, the rest from Container
    Insights' (a counter's name under the other namespace is kept for the reviewer but never corroborates)."""
    counters = set(counters)
    return [m for m in metrics
            if m.namespace == (sources.dcgm_namespace if m.name in counters else sources.container_insights_namespace)]


def collect_evidence(
    incident: Incident,
    history: Iterable[Incident],
    *,
    dcgm_counters: Iterable[str],
    sources: MetricSources,
    client: Any = None,
) -> list[InstanceEvidence]:
    """The evidence summary of each suspect instance of ``incident``, over :func:`evidence_window` of its
    alarm's time and its record time, from ``sources``' namespaces only (each named in the reasons)."""
    history = list(history)
    dcgm_counters = list(dcgm_counters)
    start, end = evidence_window(incident.alarm.time, incident.created_at)
    out = []
    for instance_id in incident.instance_ids:
        metrics = instance_metrics(instance_id, start, end, namespaces=sources.namespaces, client=client)
        prior = prior_incidents_of(instance_id, history, exclude=incident.incident_id)
        confirmed = confirmed_incidents_of(instance_id, history, exclude=incident.incident_id)
        verdict, reasons = verdict_for(from_namespaces(metrics, dcgm_counters, sources), dcgm_counters, confirmed)
        reasons.append(sources.describe())
        unconfirmed = sorted(set(prior) - set(confirmed))
        if unconfirmed:
            reasons.append(
                f"also named in {len(unconfirmed)} earlier incident(s) nobody approved (not counted): {', '.join(unconfirmed)}"
            )
        out.append(
            InstanceEvidence(
                instance_id=instance_id,
                verdict=verdict,
                reasons=reasons,
                metrics=metrics,
                prior_incidents=prior,
                window_start=start,
                window_end=end,
                namespaces=sources.namespaces,
            )
        )
    return out


def summary(evidence: list[InstanceEvidence], sources: MetricSources | None = None) -> dict[str, object]:
    """The ledger's and the reviewer's form: an overall verdict, where the metrics came from, and one entry per
    instance."""
    overall = CORROBORATED if any(e.verdict == CORROBORATED for e in evidence) else NO_HARDWARE_SIGNAL
    found: dict[str, object] = {
        "verdict": overall,
        "note": HEALTHY_DCGM_NOTE,
        "instances": [e.model_dump(mode="json") for e in evidence],
    }
    if sources is not None:
        found["sources"] = {**sources.model_dump(), "summary": sources.describe()}
    return found


def evidence_for_incident(
    ledger: Ledger,
    incident_id: str,
    *,
    dcgm_counters: Iterable[str],
    sources: MetricSources | None = None,
    cloudwatch: Any = None,
    actor: str = "evidence",
) -> Incident:
    """Collect and record the evidence (CORDONED -> EVIDENCE_COLLECTED). Idempotent.

    The earlier incidents of each suspect instance (in the same HyperPod
    cluster) come from one query per instance (:meth:`Ledger.naming`), never a
    scan. ``sources``: the namespaces to read (default: the settings' defaults).
    Raises :class:`IncidentNotWaiting` before the node is cordoned.
    """
    sources = sources or MetricSources(dcgm_namespace=DEFAULT_DCGM_NAMESPACE,
                                       container_insights_namespace=DEFAULT_CONTAINER_INSIGHTS_NAMESPACE)
    incident = ledger.get(incident_id)
    if incident.entered(IncidentState.EVIDENCE_COLLECTED):
        return incident
    if incident.state != IncidentState.CORDONED:
        raise IncidentNotWaiting(f"incident {incident_id} is {incident.state.value}; evidence follows the cordon")
    # Each instance's own history, through the ledger's index of incidents by suspect instance: the
    # step reads the incidents that named these instances, not every incident ever opened.
    cluster = incident.alarm.job.hyperpod_cluster
    history = {
        other.incident_id: other
        for instance_id in incident.instance_ids
        for other in ledger.naming(instance_id)
        if other.alarm.job.hyperpod_cluster == cluster
    }
    found = summary(collect_evidence(incident, history.values(), dcgm_counters=dcgm_counters, sources=sources,
                                     client=cloudwatch), sources)
    reproduction = checks_of(incident, "reproduce")
    if reproduction:
        # The replay of the capsule on the cordoned suspect (sdcguard.lambdas.node_check): beside the hardware's own
        # counters, the one piece of evidence that the node gets the job's computation wrong.
        found["reproduction"] = reproduce_summary(reproduction)
    return ledger.update(
        incident_id,
        lambda current: current
        if current.state != IncidentState.CORDONED
        else current.advance(IncidentState.EVIDENCE_COLLECTED, actor=actor, note=str(found["verdict"]), evidence=found),
    )
