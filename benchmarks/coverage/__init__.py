"""How much silent corruption does sdcguard catch? A fault-injection campaign (``./dev bench coverage``).

Faults drawn from realistic models (bit flips in matrix products, a faulty
lane, activations, weights, gradients, one rank's all-reduce result, the
optimizer's update, checkpoint objects; transient, intermittent or
persistent) are injected from outside the real ``agent.SDCGuard`` on 3
simulated nodes; each faulted run is compared bit for bit with the clean run,
and every sdcguard detector alone, all of them together, and the baselines
teams use today (a loss-spike monitor, the MAD outlier test on gradient
norms) are judged on the same runs. A clean soak counts false alarms.

``run_campaign(Settings(...), out_dir)`` for code, ``main(argv)`` for the
command line; see ``campaign.py``.
"""

from benchmarks.coverage.campaign import QUICK, CampaignFailed, Settings, main, run_campaign

__all__ = ["QUICK", "CampaignFailed", "Settings", "main", "run_campaign"]
