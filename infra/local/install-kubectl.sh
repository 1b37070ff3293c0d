#!/usr/bin/env bash
# Install kubectl where it is missing: tests/functional/test_kubectl.py runs the
# real binary against the local stand-in and fails (it does not skip) without it.
#
#   infra/local/install-kubectl.sh        # a no-op when kubectl is on PATH
#
# From the machine's apt sources: the package "kubectl" where a Kubernetes or
# Google Cloud repository provides it, else Debian's "kubernetes-client".
set -euo pipefail

if command -v kubectl >/dev/null 2>&1; then
    kubectl version --client 2>/dev/null | sed -n 1p  # sed reads it all: head could close the pipe early (SIGPIPE under pipefail)
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
$sudo apt-get update
if apt-cache show kubectl >/dev/null 2>&1; then
    package=kubectl
else
    package=kubernetes-client
fi
$sudo apt-get install -y --no-install-recommends "$package"
kubectl version --client 2>/dev/null | sed -n 1p
