"""How much silent corruption does sdcguard catch? A fault-injection campaign (``sdcguard campaign``).

Faults drawn from realistic models (bit flips in matrix products, a faulty
lane, activations, weights, gradients, one rank's all-reduce result, the
optimizer's update, checkpoint objects; transient, intermittent or
persistent) are injected from outside the real ``sdcguard.agent.SDCGuard`` on 3
simulated nodes; each faulted run is compared bit for bit with the clean run,
and every sdcguard detector alone, all of them together, and the baselines
teams use today (a loss-spike monitor, the MAD outlier test on gradient
norms) are judged on the same runs. A clean soak counts false alarms. The job
trained is the reference TinyGPT or a team's own, through a factory
(``sdcguard.campaign.job``, ``--job``).

``run_campaign(Settings(...), out_dir)`` for code, ``main(argv)`` for the
command line; see ``campaign.py``. The names are imported on first use, so
that the command line's ``--help`` does not load torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["QUICK", "CampaignFailed", "Settings", "main", "run_campaign"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from sdcguard.campaign import campaign as _campaign

        return getattr(_campaign, name)
    raise AttributeError(f"module 'sdcguard.campaign' has no attribute {name!r}")
