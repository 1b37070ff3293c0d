"""Record: open the incident for an alarm, or count a duplicate into the one already open."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from sdcguard.contract import Alarm, Incident
from sdcguard.lambdas.errors import AlarmFromTheFuture, NotInCluster
from sdcguard.lambdas.ledger import Ledger
from sdcguard.lambdas.settings import Settings


@dataclass(frozen=True)
class Recorded:
    """The outcome of recording an alarm."""

    incident: Incident
    duplicate: bool


def check_scope(alarm: Alarm, settings: Settings) -> None:
    """Raises :class:`NotInCluster` unless ``alarm`` is about what this deployment guards.

    That is the HyperPod and EKS cluster, and the job namespace; a deployment
    without ``JOB_NAMESPACE`` guards no namespace, and one without ``JOB_NAME``
    no job, so it acts on no alarm. Whether the alarm is about the guarded job
    is :func:`check_job`'s question, asked by ``resolve``.
    """
    job = alarm.job
    if job.hyperpod_cluster != settings.hyperpod_cluster or job.eks_cluster != settings.eks_cluster:
        raise NotInCluster(
            f"alarm {alarm.alarm_id} is for HyperPod {job.hyperpod_cluster} / EKS {job.eks_cluster}; "
            f"this pipeline guards HyperPod {settings.hyperpod_cluster} / EKS {settings.eks_cluster}"
        )
    if not settings.job_namespace:
        raise NotInCluster(
            f"alarm {alarm.alarm_id}: this deployment guards no namespace (JobNamespace / JOB_NAMESPACE is empty); "
            "nothing is acted on"
        )
    if job.namespace != settings.job_namespace:
        raise NotInCluster(
            f"alarm {alarm.alarm_id} is for namespace {job.namespace}; this pipeline guards {settings.job_namespace}"
        )
    if not settings.job_name:
        raise NotInCluster(
            f"alarm {alarm.alarm_id}: this deployment guards no job (JobName / JOB_NAME is empty); nothing is acted on"
        )


CLOCK_SKEW: Final = timedelta(minutes=5)
"""How far ahead of the pipeline's clock an alarm's ``time`` may be (the training nodes' clocks drift)."""


def check_time(alarm: Alarm, now: datetime | None = None) -> None:
    """Raises :class:`AlarmFromTheFuture` when ``alarm`` is dated more than :data:`CLOCK_SKEW` after ``now``
    (default: this clock): the alarm's own ``time`` is what its publisher wrote, and a date to come would let
    it place the incident's history and evidence where it likes."""
    now = now or datetime.now(UTC)
    if alarm.time > now + CLOCK_SKEW:
        raise AlarmFromTheFuture(
            f"alarm {alarm.alarm_id} is dated {alarm.time.isoformat()}, {(alarm.time - now).total_seconds():.0f} s "
            f"after the pipeline's clock ({now.isoformat(timespec='seconds')}; the allowance for clock skew is "
            f"{CLOCK_SKEW.total_seconds():.0f} s): refused, nothing recorded or touched"
        )


def check_job(alarm: Alarm, settings: Settings) -> None:
    """Raises :class:`NotInCluster` unless ``alarm`` is about the PyTorchJob this deployment guards (``JOB_NAME``).

    Asked after the incident is opened, not by :func:`check_scope`: an alarm from
    another job of the guarded namespace may be a true report about hardware the
    guarded job shares, so it is recorded and stops for attention, with nothing touched.
    """
    job = alarm.job
    if job.job_name != settings.job_name:
        raise NotInCluster(
            f"alarm {alarm.alarm_id} is for PyTorchJob {job.namespace}/{job.job_name!r}; this pipeline guards "
            f"{settings.job_namespace}/{settings.job_name!r} (JobName / JOB_NAME); nothing touched"
        )


def record_alarm(
    ledger: Ledger, alarm: Alarm, settings: Settings, *, opened_by: str | None = None, actor: str = "record"
) -> Recorded:
    """Open (or deduplicate into) the incident of ``alarm``.

    ``opened_by`` is the recording execution: the same execution recording
    again (a retry) gets its own incident back, not a duplicate. Raises
    :class:`NotInCluster`, writing nothing, for an alarm outside what the
    settings guard (:func:`check_scope`), and :class:`AlarmFromTheFuture`,
    writing nothing, for one dated ahead of this clock (:func:`check_time`).
    """
    check_scope(alarm, settings)
    check_time(alarm)
    incident, created = ledger.open(alarm, mode=settings.mode, actor=actor, opened_by=opened_by)
    return Recorded(incident=incident, duplicate=not created)
