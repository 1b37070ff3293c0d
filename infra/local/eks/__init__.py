"""A local Kubernetes API server that stands in for an EKS cluster's endpoint.

It serves, over HTTPS with its own CA, the part of the Kubernetes REST API the
incident pipeline touches (nodes, pods, Kubeflow PyTorchJobs) and accepts only
EKS-style bearer tokens, so the handlers reach it through exactly the code
path they use against a real cluster.
"""
