"""How big a campaign is: its ``Settings``, and ``QUICK``, the short form the tests run.

The parent validates them and hands them to every rank in the plan
(``rank_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sdcguard.campaign.faults import CAMPAIGN_MODELS, MODELS
from sdcguard.campaign.job import REFERENCE_JOB, module_and_function


@dataclass(frozen=True)
class Settings:
    """How big the campaign is. Bad values raise ``ValueError`` naming the field."""

    faults_per_model: int = 51
    """Faults drawn per fault model (persistence cycles transient, intermittent, persistent)."""
    models: tuple[str, ...] = CAMPAIGN_MODELS
    horizon: int = 12
    """Steps a faulted run trains from the fault's first step (also a fault's window)."""
    lead: int = 2
    """Clean steps a faulted run trains before its fault (the magnitude trigger starts it with the clean run's
    history up to there: its full window from step 32 on)."""
    first_step: int = 24
    """The earliest fault step (the baselines' running statistics warm up before it)."""
    span: int = 20
    """Fault steps are drawn uniformly from ``first_step .. first_step + span - 1``."""
    audit_every: int = 10
    """The ring audit's cadence in the campaign's runs (GuardConfig's default is 100: a window of ``horizon``
    steps then rarely holds an audit)."""
    fingerprint_every: int = 5
    checkpoint_every: int = 10
    """The job's checkpoint cadence, for the rollback each alarm would lead to."""
    checkpoint_gap: int = 5
    """checkpoint faults: the steps between the two checkpoints written."""
    soak_steps: int = 33_334
    """Clean steps of the soak (times 3 ranks: >= 100,000 rank-steps)."""
    world: int = 3
    worlds: int = 2
    """Process groups of ``world`` ranks that share the faults (the first runs the clean checks, the last the
    soak). On 2 cores 3 ranks leave a core idle whenever two wait for the third in a collective; a second
    group fills it (the throughput measured, with its date: docs/coverage.md, "The job"). The outcomes do not
    depend on it."""
    product_checks: bool = False
    """Also run the product checks (GuardConfig.product_checks, off in its defaults): the rows ``product_checks``
    (alone) and ``all_products`` (``all`` with them on), beside ``all`` (with them off)."""
    derive: bool = True
    """Skip training a detector's run where the run without detectors already proves it silent (the non-finite
    check alone when every loss and gradient stayed finite, the reduced-gradient comparison alone when every
    rank received the same reduced gradients); ``--no-derive`` trains them all. A replay trains them all."""
    seed: int = 0
    device: str = "cpu"
    """``cpu`` (gloo), or ``cuda``: one GPU per rank (``world`` GPUs), NCCL."""
    job: str = REFERENCE_JOB
    """The job to train: a factory ``package.module:function``, called as ``function(job_seed)`` and returning
    a ``sdcguard.campaign.job.CampaignJob`` (``--job``; default: the reference TinyGPT job)."""
    job_seed: int = 0
    """The seed handed to the job's factory and to the guard's replays."""
    timeout_s: float = 4 * 3600.0

    def __post_init__(self) -> None:
        for name in ("faults_per_model", "horizon", "first_step", "span", "checkpoint_every", "checkpoint_gap",
                     "world", "worlds", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("lead", "audit_every", "fingerprint_every", "soak_steps", "seed", "job_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: must be cpu or cuda, got {self.device!r}")
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"models: unknown fault model(s) {unknown}; known: {', '.join(MODELS)}")
        if self.world < 3:
            raise ValueError(f"world: the ring audit localises only with 3 or more nodes, got {self.world}")
        if self.first_step <= max(self.checkpoint_gap, self.lead):
            raise ValueError(f"first_step: must exceed checkpoint_gap and lead, got {self.first_step}")
        module_and_function(self.job)

    @property
    def last_step(self) -> int:
        """The clean reference runs to here: the last fault's window ends at it."""
        return self.first_step + self.span + self.horizon


QUICK = Settings(faults_per_model=1, models=(*CAMPAIGN_MODELS, "null"), horizon=8, span=10, soak_steps=150,
                 first_step=12, timeout_s=1800.0)
"""The short form the test runs: one fault per model (the models take turns at transient, intermittent and
persistent) and the null control, an 8-step window, a 450-rank-step soak; faults from step 12, where the
trigger has its warm-up (10 steps) of history, not yet its full window."""
