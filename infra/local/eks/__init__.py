"""A local Kubernetes API server that stands in for an EKS cluster's endpoint.

It serves, over HTTPS with its own CA, the part of the Kubernetes REST API the
incident pipeline touches (nodes, pods, Jobs, Kubeflow PyTorchJobs) and accepts only
EKS-style bearer tokens, so the handlers reach it through exactly the code
path they use against a real cluster. Jobs run for real, as local processes
with their node's identity and simulated hardware faults (``jobs``,
``job_runner``, ``node_faults``); a replay Job is forked from a process that
imported torch once (``zygote``). ``server`` puts the parts together.
"""
