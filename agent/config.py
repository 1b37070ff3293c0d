"""GuardConfig: every setting of the in-job agent, validated, also from ``SDCGUARD_*`` variables."""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

OnAlarm = Literal["stop", "raise", "continue"]
OnCheckpointFailure = Literal["continue", "raise"]
AutocastDtype = Literal["bfloat16", "float16"]
OnEnvironmentMismatch = Literal["refuse", "degrade"]
OnNonreproducible = Literal["stop", "continue"]

ALARM_EXIT_CODE = 87
"""The exit status of a rank stopped by an alarm under ``on_alarm="stop"``.

Distinct from Python's 1 (an exception), torchrun's failures and the signal
codes (128+N), so a job controller can tell "stopped on suspect hardware" apart.
"""

ENV_PREFIX = "SDCGUARD_"
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class GuardConfig:
    """The agent's settings. Bad values raise ``ValueError`` naming the field."""

    on_alarm: OnAlarm = "stop"
    """What to do after an alarm is published: exit with ALARM_EXIT_CODE, raise GuardAlarm, or return it."""
    ranks_per_node: int | None = None
    """Ranks per node; None reads LOCAL_WORLD_SIZE (1 when unset). Set it to simulate nodes on one machine."""
    audit_every: int = 100
    """Run the ring re-execution audit on steps that are multiples of this; 0 turns it off."""
    fingerprint_every: int = 10
    """Compare weight and optimizer-state fingerprints on steps that are multiples of this; 0 turns it off."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: with K > 1, ``batch_for(step, rank)`` returns a sequence of K, each
    loss is divided by K before its backward, and DDP synchronises on the last one only."""
    max_grad_norm: float | None = None
    """Clip the global norm of the reduced gradients to this (``clip_grad_norm_``) after every check passed
    and after unscaling; None does not clip."""
    autocast_dtype: AutocastDtype | None = None
    """Run every forward the guard runs (the rank's own and every recomputation) under ``torch.autocast``
    with this dtype: "bfloat16" or "float16"; None runs them as the model is."""
    nonfinite: bool = True
    """Check gradients for NaN/Inf before and after the all-reduce (detector 1)."""
    reduced_grad: bool = True
    """Compare the fingerprints of the reduced gradients across ranks on every step."""
    max_scaler_overflow_steps: int = 30
    """With a GradScaler, consecutive overflow steps tolerated before it is an alarm."""
    confirm: bool = True
    """Before blaming hardware, recompute a suspicious rank's micro-batch on other nodes in the same step."""
    trigger_ratio: float = 4.0
    """The magnitude trigger fires when a rank's loss rises, or its local gradient norm moves, by more than
    this factor against the median of its own recent steps; 0 turns it off."""
    trigger_window: int = 32
    """Steps of each rank's history the magnitude trigger compares against."""
    trigger_warmup: int = 10
    """Steps of history the magnitude trigger needs before it fires at all."""
    product_checks: bool = False
    """Check every matrix product (forward, both backward) by checksums against a rigorous rounding bound."""
    max_data_faults: int = 10
    """Consecutive steps skipped for a data fault (a NaN/Inf the recomputation reproduced) before
    DataFaultLimit is raised: the run is broken, not the hardware."""
    seed: int = 0
    """Base of the per-(step, rank) random seeds that make dropout reproducible for the audit."""
    threads: int = 1
    """Intra-op threads pinned on every CPU rank (recomputation there is bit-identical only with equal counts);
    0 leaves torch's. GPU ranks keep the job's count: their recomputation runs on the GPU."""
    deterministic: bool = True
    """With any recompute-based check on (audit, confirmation), turn on torch's deterministic algorithms (not
    warn_only), deterministic cuDNN and CUBLAS_WORKSPACE_CONFIG on CUDA (``sdcguard.agent.determinism``); False leaves
    them to the job."""
    on_environment_mismatch: OnEnvironmentMismatch = "refuse"
    """When ranks differ in what bit-exact recomputation depends on (GPU model, software versions, TF32, SDPA
    backends, deterministic mode, ...): "refuse" to start, naming what differs, or "degrade": run without the
    recompute-based checks (audit, confirmation), with a warning."""
    on_nonreproducible: OnNonreproducible = "stop"
    """When recomputations of one micro-batch all disagree (non-reproducible computation, no rank blamed):
    "stop" raises an error saying so (no alarm), "continue" warns, counts it and trains on."""
    event_bus: str = "sdcguard"
    """EventBridge bus the alarm is published to."""
    publish_budget_s: float = 10.0
    """The longest publishing may take, retries and spooling included."""
    publish_retries: int = 3
    """PutEvents attempts before the alarm is spooled."""
    spool_dir: str = "sdcguard-spool"
    """Local folder where alarms are written when EventBridge cannot be reached (never with ``publisher=None``)."""
    spool_max_age_s: float = 7 * 24 * 3600.0
    """Spooled alarms older than this (seconds) are not republished at start (they are left in the spool)."""
    checkpoint_prefix: str = "sdcguard-checkpoints"
    """``s3://bucket/prefix`` or a local folder under which checkpoints and RESUME.json live."""
    checkpoint_retries: int = 3
    """Attempts of a checkpoint save that failed to store (an S3 outage) before on_checkpoint_failure applies."""
    checkpoint_retry_delay_s: float = 2.0
    """Wait before the second attempt; it doubles for each further one."""
    on_checkpoint_failure: OnCheckpointFailure = "continue"
    """After the last failed attempt: log it and train on (the resume pointer keeps the last good
    checkpoint), or raise CheckpointSaveFailed."""
    capsule_factory: str | None = None
    """``package.module:function`` returning ``(model, loss_fn)``, with which ``sdcguard replay`` rebuilds the
    model in a fresh process; a localised recomputation alarm writes a replay capsule only when it is set."""
    capsule_max_bytes: int = 1024**3
    """The largest replay capsule (weights, buffers and the suspect's micro-batches) written beside the
    checkpoints, in bytes; above it none is written and the alarm says so."""
    hyperpod_cluster: str = "local-hyperpod"
    """Name of the SageMaker HyperPod cluster running the job."""
    eks_cluster: str = "local-eks"
    """Name of the EKS cluster orchestrating it."""
    namespace: str = "default"
    """Kubernetes namespace of the PyTorchJob."""
    job_name: str = "sdcguard-job"
    """Name of the PyTorchJob."""

    def __post_init__(self) -> None:
        if self.on_alarm not in ("stop", "raise", "continue"):
            raise ValueError(f"on_alarm: must be one of stop, raise, continue; got {self.on_alarm!r}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node: must be >= 1, got {self.ranks_per_node}")
        if self.on_checkpoint_failure not in ("continue", "raise"):
            raise ValueError(f"on_checkpoint_failure: must be continue or raise; got {self.on_checkpoint_failure!r}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps: must be >= 1, got {self.grad_accum_steps}")
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < float("inf"):
            raise ValueError(f"max_grad_norm: must be None or a finite number > 0, got {self.max_grad_norm}")
        if self.on_environment_mismatch not in ("refuse", "degrade"):
            raise ValueError(f"on_environment_mismatch: must be refuse or degrade; got {self.on_environment_mismatch!r}")
        if self.on_nonreproducible not in ("stop", "continue"):
            raise ValueError(f"on_nonreproducible: must be stop or continue; got {self.on_nonreproducible!r}")
        if not self.spool_max_age_s > 0:
            raise ValueError(f"spool_max_age_s: must be > 0, got {self.spool_max_age_s}")
        if self.autocast_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast_dtype: must be bfloat16, float16 or None; got {self.autocast_dtype!r}")
        for name in ("audit_every", "fingerprint_every", "max_scaler_overflow_steps", "threads", "seed",
                     "max_data_faults"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.trigger_ratio != 0 and not self.trigger_ratio > 1:
            raise ValueError(f"trigger_ratio: must be 0 (off) or > 1, got {self.trigger_ratio}")
        if self.trigger_window < 1:
            raise ValueError(f"trigger_window: must be >= 1, got {self.trigger_window}")
        if not 1 <= self.trigger_warmup <= self.trigger_window:
            raise ValueError(f"trigger_warmup: must be between 1 and trigger_window ({self.trigger_window}), "
                             f"got {self.trigger_warmup}")
        if self.capsule_max_bytes < 0:
            raise ValueError(f"capsule_max_bytes: must be >= 0, got {self.capsule_max_bytes}")
        if self.capsule_factory is not None and not _FACTORY.fullmatch(self.capsule_factory):
            raise ValueError(f"capsule_factory: must be package.module:function (e.g. mypkg.sdc:replay_model), "
                             f"got {self.capsule_factory!r}")
        if self.checkpoint_retries < 1:
            raise ValueError(f"checkpoint_retries: must be >= 1, got {self.checkpoint_retries}")
        if self.checkpoint_retry_delay_s < 0:
            raise ValueError(f"checkpoint_retry_delay_s: must be >= 0, got {self.checkpoint_retry_delay_s}")
        if self.publish_retries < 1:
            raise ValueError(f"publish_retries: must be >= 1, got {self.publish_retries}")
        if not self.publish_budget_s > 0:
            raise ValueError(f"publish_budget_s: must be > 0, got {self.publish_budget_s}")
        for name in ("event_bus", "spool_dir", "checkpoint_prefix", "hyperpod_cluster", "eks_cluster",
                     "namespace", "job_name"):
            value = getattr(self, name)
            if not value or len(value) > 1024:
                raise ValueError(f"{name}: must be a non-empty string of at most 1024 characters, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GuardConfig:
        """Settings from ``SDCGUARD_<FIELD>`` variables, then ``overrides`` (which win).

        Raises ``ValueError`` naming the field (and the variable) for a value
        that does not parse or does not validate.
        """
        env = os.environ if env is None else env
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            try:
                values[f.name] = _parse(raw, hints[f.name])
            except ValueError as exc:
                raise ValueError(f"{f.name}: {ENV_PREFIX}{f.name.upper()}={raw!r} is not valid: {exc}") from None
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not a GuardConfig field")
        values.update(overrides)
        return cls(**values)


def _parse(raw: str, hint: Any) -> Any:
    """Parse one environment value into the field's type."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if raw.strip().lower() in ("", "none"):
            return None
        return _parse(raw, next(a for a in args if a is not type(None)))
    if origin is Literal:
        return raw.strip()
    if hint is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true/false")
    if hint is int:
        return int(raw)
    if hint is float:
        return float(raw)
    return raw


__all__ = ["ALARM_EXIT_CODE", "AutocastDtype", "GuardConfig", "OnAlarm", "OnCheckpointFailure", "OnEnvironmentMismatch",
           "OnNonreproducible"]
