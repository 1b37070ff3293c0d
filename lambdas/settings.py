"""The handlers' settings: environment variables validated once at cold start."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# The DCGM counters that, when the cluster's CloudWatch agent scrapes
# dcgm-exporter, say the hardware itself noticed something.
DEFAULT_DCGM_METRICS = (
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
)
# Where the EKS Container Insights add-on publishes the GPU metrics, dcgm-exporter's counters included: the
# evidence reads these namespaces only, since anyone with cloudwatch:PutMetricData (the training role too) can
# publish a metric of the same name and InstanceId under a namespace of their own.
DEFAULT_DCGM_NAMESPACE = "ContainerInsights"
DEFAULT_CONTAINER_INSIGHTS_NAMESPACE = "ContainerInsights"


IMAGE_BY_DIGEST = r"^$|^[a-z0-9][a-z0-9._/:-]{0,254}@sha256:[0-9a-f]{64}$"
FACTORY_LIST = r"^$|^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)*$"
"""``module:function`` names, comma-separated, as the template's ``NodeCheckFactories`` allows them."""
"""An image named by its digest (``registry/repository@sha256:<64 hex>``): a tag can be moved, a digest cannot."""


class SettingsError(ValueError):
    """An environment variable is missing or invalid; the message names it."""


class Settings(BaseModel):
    """What every handler reads from its environment; each field's alias is its variable (shared with the template)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    ledger_table: Annotated[str, Field(alias="LEDGER_TABLE", min_length=3)]
    """DynamoDB table of the incident ledger."""
    token_table: Annotated[str, Field(alias="TOKEN_TABLE")] = ""
    """DynamoDB table of the approval task tokens, which only request_approval and decide may read
    (:mod:`sdcguard.lambdas.task_tokens`). Empty: approvals can be neither asked nor answered."""
    idempotency_table: Annotated[str, Field(alias="IDEMPOTENCY_TABLE", min_length=3)]
    """DynamoDB table of powertools' idempotency records."""
    topic_arn: Annotated[str, Field(alias="TOPIC_ARN", pattern=r"^arn:aws[a-z-]*:sns:")]
    """SNS topic the reviewers subscribe to."""
    hyperpod_cluster: Annotated[str, Field(alias="HYPERPOD_CLUSTER", min_length=1)]
    """The HyperPod cluster this pipeline guards: alarms for any other are refused."""
    eks_cluster: Annotated[str, Field(alias="EKS_CLUSTER", min_length=1)]
    """The EKS cluster that orchestrates it."""
    job_namespace: Annotated[str, Field(alias="JOB_NAMESPACE")] = ""
    """The namespace of the guarded job. Empty: no alarm is acted on (each is refused, naming this)."""
    job_name: Annotated[str, Field(alias="JOB_NAME")] = ""
    """The guarded PyTorchJob in that namespace. Empty: no alarm is acted on (each is refused, naming this);
    an alarm for another job stops for attention at resolve, touching nothing."""
    checkpoint_bucket: Annotated[str, Field(alias="CHECKPOINT_BUCKET", min_length=3)]
    """The bucket of the checkpoints the pipeline may rewrite the pointer in."""
    checkpoint_prefix: Annotated[str, Field(alias="CHECKPOINT_PREFIX")] = ""
    """The guarded job's checkpoint prefix inside it: an alarm must name exactly this one (empty: the bucket's root)."""
    mode: Annotated[Literal["normal", "dry_run", "cordon_only"], Field(alias="MODE")] = "normal"
    """dry_run decides and records only; cordon_only contains and stops for a human."""
    max_quarantined_nodes: Annotated[int, Field(alias="MAX_QUARANTINED_NODES", ge=0)] = 2
    """Nodes under sdcguard quarantine at once, per cluster."""
    max_replacements_per_day: Annotated[int, Field(alias="MAX_REPLACEMENTS_PER_DAY", ge=0)] = 4
    """Replacements requested in any 24 hours, per cluster."""
    approval_timeout_seconds: Annotated[int, Field(alias="APPROVAL_TIMEOUT_SECONDS", ge=2, le=31_536_000)] = 14_400
    """How long a reviewer has to decide before the incident stops safely."""
    max_alarm_age_seconds: Annotated[int, Field(alias="MAX_ALARM_AGE_SECONDS", ge=60, le=31_536_000)] = 3600
    """An alarm raised longer ago than this (a spooled or re-delivered one) stops for attention at resolve, touching nothing."""
    dcgm_metric_names: Annotated[tuple[str, ...], Field(alias="DCGM_METRIC_NAMES")] = DEFAULT_DCGM_METRICS
    """DCGM counters published to CloudWatch whose non-zero value corroborates an alarm."""
    dcgm_namespace: Annotated[str, Field(alias="DCGM_NAMESPACE", min_length=1, max_length=255)] = DEFAULT_DCGM_NAMESPACE
    """The CloudWatch namespace the DCGM counters are read from (no other namespace's metric of that name counts)."""
    container_insights_namespace: Annotated[
        str, Field(alias="CONTAINER_INSIGHTS_NAMESPACE", min_length=1, max_length=255)
    ] = DEFAULT_CONTAINER_INSIGHTS_NAMESPACE
    """The CloudWatch namespace the GPU metrics of Container Insights (temperature, power, ...) are read from."""
    decide_state_machine_arn: Annotated[str, Field(alias="DECIDE_STATE_MACHINE_ARN")] = ""
    """The decision machine, named in the reviewers' notification."""
    replacement_poll_seconds: Annotated[int, Field(alias="REPLACEMENT_POLL_SECONDS", ge=1, le=3600)] = 30
    """How often the wait loop asks HyperPod whether the replacement runs."""
    replacement_max_polls: Annotated[int, Field(alias="REPLACEMENT_MAX_POLLS", ge=1, le=10_000)] = 120
    """The wait loop's upper bound: after this many polls the replacement has failed (deploy bounds it by the execution history limit)."""

    node_check_repeats: Annotated[int, Field(alias="NODE_CHECK_REPEATS", ge=1, le=100)] = 5
    """How many times a node check replays the capsule: the suspect's reproduction and each replacement's
    qualification (which must match every time)."""
    node_check_deadline_seconds: Annotated[int, Field(alias="NODE_CHECK_DEADLINE_SECONDS", ge=10, le=86_400)] = 900
    """A node check Job's ``activeDeadlineSeconds``: past it the check is inconclusive."""
    node_check_poll_seconds: Annotated[int, Field(alias="NODE_CHECK_POLL_SECONDS", ge=1, le=3600)] = 15
    """How often the state machine's wait loop reads the node check Jobs."""
    node_check_max_polls: Annotated[int, Field(alias="NODE_CHECK_MAX_POLLS", ge=1, le=10_000)] = 70
    """The node check loop's upper bound: after this many polls the checks still running are inconclusive
    (70 x 15 s covers the Job's default 900 s deadline; deploy bounds it by the execution history limit)."""
    node_check_image: Annotated[str, Field(alias="NODE_CHECK_IMAGE", pattern=IMAGE_BY_DIGEST)] = ""
    """The image the node check Jobs run (``<repository>@sha256:<64 hex>``, the stack's ``NodeCheckImage``): the
    pipeline's own, never the training job's. Empty: no node check is run (each is recorded as not run, naming it)."""
    node_check_factories: Annotated[str, Field(alias="NODE_CHECK_FACTORIES", pattern=FACTORY_LIST)] = ""
    """The capsule factories a node check's replay may import (``module:function``, comma-separated; the stack's
    ``NodeCheckFactories``), handed to ``sdcguard replay`` as ``--allow-factory``: the pipeline's allow-list, never
    the training's environment. Empty: every replay refuses its capsule's factory (the check is inconclusive)."""
    node_check_accept_injected_faults: Annotated[bool, Field(alias="NODE_CHECK_ACCEPT_INJECTED_FAULTS")] = False
    """Take a replay report that says a fault was injected (``SDCGUARD_INJECT``) as the node's answer: only on the
    stand-in, whose simulated faulty GPUs are injections (``sdcguard deploy`` refuses it on AWS). Otherwise such a
    report is refused (inconclusive): it is what someone made the node say."""
    max_replacement_rounds: Annotated[int, Field(alias="MAX_REPLACEMENT_ROUNDS", ge=1, le=10)] = 2
    """Replacement rounds in all for one incident: a replacement that fails qualification is replaced again
    only while fewer rounds than this were made (and within the blast-radius limits)."""

    def timeouts(self) -> dict[str, int]:
        """The bounds the state machine reads from its data (HeartbeatSecondsPath, TimeoutSecondsPath, SecondsPath).

        Nobody heartbeats the approval task, so the heartbeat is the effective
        approval window; the task's timeout is a hard bound a little after it.
        """
        window = self.approval_timeout_seconds
        return {
            "approval_heartbeat_seconds": window,
            "approval_seconds": window + min(60, max(1, window // 10)),
            "replacement_poll_seconds": self.replacement_poll_seconds,
            "replacement_max_polls": self.replacement_max_polls,
            "node_check_poll_seconds": self.node_check_poll_seconds,
            "node_check_max_polls": self.node_check_max_polls,
        }

    @field_validator("dcgm_metric_names", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(name.strip() for name in value.split(",") if name.strip())
        return value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``environ`` (default: the process environment).

        Raises :class:`SettingsError` naming the variable that is missing or invalid.
        """
        environ = os.environ if environ is None else environ
        missing = [name for name in REQUIRED if not environ.get(name)]
        if missing:
            raise SettingsError(f"missing environment variable(s): {', '.join(missing)}")
        # An empty variable (a template parameter left at "") means the field's default.
        values = {name: environ[name] for name in ENV if environ.get(name)}
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(f"{err['loc'][0]}: {err['msg']}" for err in exc.errors())
            raise SettingsError(f"invalid environment: {problems}") from None
        return settings


ENV: dict[str, str] = {str(field.alias): name for name, field in Settings.model_fields.items()}
"""Environment variable -> field: the variables the template sets on every function."""
REQUIRED = tuple(str(f.alias) for f in Settings.model_fields.values() if f.is_required())


@functools.cache
def get_settings() -> Settings:
    """The process's settings, read and validated once (cold start). Raises :class:`SettingsError`."""
    return Settings.from_env()
