"""``sdcguard local``: the local stand-in for AWS and EKS.

``sdcguard local up`` runs the stand-in in the foreground until interrupted;
its first lines are shell exports, so ``eval`` or a copy and paste points any
AWS tool at it. ``sdcguard local seed`` (:func:`sdcguard.infra.local.seed.seed`) fills a
running stand-in with a simulated HyperPod cluster and training job.
``sdcguard local kubeconfig`` (:func:`sdcguard.infra.local.kubeconfig.write_kubeconfig`)
points kubectl at the stand-in's EKS cluster, through the credential plugin
``sdcguard local exec-credential``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import NoReturn

from sdcguard.errors import CommandError


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``up`` and ``seed`` subcommands."""
    sub = parser.add_subparsers(dest="local_command", metavar="LOCAL_COMMAND")
    sub.required = True
    up = sub.add_parser(
        "up",
        help="run the moto server with sdcguard's extensions and the local EKS API server until Ctrl-C",
        description="Start the local stand-in on 127.0.0.1 and print the shell exports that point AWS tools at it.",
    )
    up.add_argument("--port", type=_port, default=5000, help="moto server port (default 5000; 0 picks a free one)")
    up.add_argument("--eks-port", type=_port, default=0, help="local EKS API server port (default: a free one)")
    up.add_argument(
        "--replace-seconds",
        type=_seconds,
        default=5.0,
        help="how long each simulated HyperPod phase (shutdown, pending, reboot, health check) lasts (default 5)",
    )
    up.set_defaults(_local_run=run_up)
    seed_help = "create a simulated HyperPod cluster, nodes, training job, bucket and GPU metrics on a running stand-in"
    seed = sub.add_parser("seed", help=seed_help, description=seed_help)
    configure_seed(seed)
    seed.set_defaults(_local_run=run_seed)
    kubeconfig_help = "point kubectl at the stand-in's EKS cluster, as `aws eks update-kubeconfig` does for a real one"
    kubeconfig = sub.add_parser("kubeconfig", help=kubeconfig_help, description=kubeconfig_help)
    kubeconfig.add_argument("--cluster", help="EKS cluster (default: the stand-in's only one)")
    kubeconfig.add_argument(
        "--output", type=Path, help="kubeconfig file to merge into (default: $KUBECONFIG's first file, else ~/.kube/config)"
    )
    kubeconfig.set_defaults(_local_run=run_kubeconfig)
    credential_help = "print an ExecCredential with a fresh EKS token (kubectl's credential plugin; like `aws eks get-token`)"
    credential = sub.add_parser("exec-credential", help=credential_help, description=credential_help)
    credential.add_argument("--cluster", required=True, help="EKS cluster the token is for")
    credential.set_defaults(_local_run=run_exec_credential)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds must be a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen ``local`` subcommand."""
    return int(args._local_run(args) or 0)


def export_lines(env: dict[str, str]) -> list[str]:
    """``export NAME=value`` lines, quoted for a POSIX shell."""
    return [f"export {name}={shlex.quote(value)}" for name, value in env.items()]


def run_up(args: argparse.Namespace) -> int:
    """Run the stand-in until SIGINT/SIGTERM; print the exports first; then end the process (exit status 0).

    A second signal while stopping ends the process at once, by that signal.
    Raises ``CommandError`` when a port is taken or the stand-in cannot start.
    """
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            # The second signal. Python runs every pending handler at its next check, so a SIGINT and a
            # SIGTERM sent together both land here, before the stop resets the handlers: this one must end
            # the process itself, as the default action would.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop.set()
        if not serving.is_set():
            # Still starting: unwind start() (it stops whatever it began) instead of finishing it first.
            raise KeyboardInterrupt

    # Both explicitly: a shell starts a background job with SIGINT ignored. Before the stand-in's imports
    # (seconds of moto and its dependencies): a signal during them is remembered in ``stop`` even where an
    # import swallows the KeyboardInterrupt, and the wait below then ends at once.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Interrupted while starting: start() stops what it had begun; the teardown is skipped here too (below).
    try:
        from sdcguard.infra.local.standin import LocalStandIn, PortInUse, StandInError
    except KeyboardInterrupt:
        _end_process(130, "sdcguard: interrupted")
    standin = LocalStandIn(port=args.port, eks_port=args.eks_port, replace_seconds=args.replace_seconds)
    try:
        standin.start()
        serving.set()
    except KeyboardInterrupt:
        _end_process(130, "sdcguard: interrupted")
    except PortInUse as exc:
        option = "--port" if exc.server == "moto" else "--eks-port"
        raise CommandError(f"{exc}: `sdcguard local up {option} 0` picks a free one") from exc
    except StandInError as exc:
        raise CommandError(str(exc)) from exc
    try:
        for line in export_lines(standin.env):
            print(line)
        eks = standin.eks
        print(f"# moto with sdcguard's extensions at {standin.endpoint_url}")
        if eks is not None:
            print(f"# local EKS API server at {eks.url} (EKS DescribeCluster returns it for every cluster)")
            print("# kubectl: after `sdcguard local seed`, `sdcguard local kubeconfig` points it at the cluster")
        print(f"# started in {standin.startup_seconds:.2f} s; Ctrl-C stops it")
        sys.stdout.flush()
        # A timed wait, so the signal handler runs promptly on every platform.
        while not stop.wait(0.5):
            pass
    finally:
        # A second Ctrl-C or SIGTERM while stopping ends the process at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        began = time.monotonic()
        standin.stop()
    _end_process(0, f"# local stand-in stopped in {time.monotonic() - began:.2f} s")


def _end_process(code: int, message: str) -> NoReturn:
    """Print ``message`` to stderr and end the process with ``code`` at once.

    Everything is stopped by then, the ports released and the workers ended:
    nothing is left to tear down. The interpreter's own teardown of the
    stand-in's ~1,600 modules (moto's backends) took 2 s of CPU on a quiet
    machine and 7-10 s with the cores busy (2026-12-02), with the signal
    handlers already spent: a loaded machine saw `local up` run on 30 s
    after SIGINT and SIGTERM.
    """
    print(message, file=sys.stderr)
    with contextlib.suppress(OSError):  # a reader that went away
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def configure_seed(parser: argparse.ArgumentParser) -> None:
    """Options of ``sdcguard local seed``."""
    parser.add_argument("--nodes", type=int, default=3, help="HyperPod nodes (default 3)")
    parser.add_argument(
        "--ranks-per-node", type=int, default=2, help="GPUs (training ranks) per node (default 2)"
    )
    parser.add_argument(
        "--faulty-node",
        type=int,
        metavar="INDEX",
        help="make node INDEX (0-based) look faulty: hot GPU, Xid, ECC",
    )
    parser.add_argument(
        "--cluster", default="sdcguard-demo", help="HyperPod cluster name (default sdcguard-demo)"
    )
    parser.add_argument("--eks-cluster", help="EKS cluster name (default <cluster>-eks)")
    parser.add_argument("--job", default="llm-pretrain", help="PyTorchJob name (default llm-pretrain)")
    parser.add_argument("--namespace", default="training", help="Kubernetes namespace (default training)")
    parser.add_argument("--bucket", help="checkpoint bucket (default <cluster>-checkpoints)")


def run_seed(args: argparse.Namespace) -> int:
    """Seed the stand-in named by the AWS_* environment and print the result as one JSON object."""
    from botocore.exceptions import BotoCoreError, ClientError
    from kubernetes import client as k8s

    from sdcguard.infra.local.seed import SeedError, seed

    try:
        result = seed(
            dict(os.environ),
            nodes=args.nodes,
            ranks_per_node=args.ranks_per_node,
            faulty_node=args.faulty_node,
            cluster=args.cluster,
            eks_cluster=args.eks_cluster,
            job=args.job,
            namespace=args.namespace,
            bucket=args.bucket,
        )
    except SeedError as exc:
        raise CommandError(str(exc)) from exc
    except ClientError as exc:
        raise CommandError(f"the stand-in refused a request: {exc}") from exc
    except BotoCoreError as exc:
        raise CommandError(f"cannot reach the stand-in: {exc}") from exc
    except (k8s.ApiException, OSError) as exc:
        raise CommandError(f"the stand-in's EKS API server failed: {exc}") from exc
    print(json.dumps(result, indent=2))
    return 0


def run_kubeconfig(args: argparse.Namespace) -> int:
    """Merge the stand-in cluster's kubeconfig entries into the file and say which context kubectl now uses."""
    from botocore.exceptions import BotoCoreError, ClientError

    from sdcguard.infra.local.kubeconfig import KubeconfigError, write_kubeconfig

    try:
        path, context = write_kubeconfig(args.cluster, args.output)
    except KubeconfigError as exc:
        raise CommandError(str(exc)) from exc
    except ClientError as exc:
        raise CommandError(f"the stand-in refused DescribeCluster: {exc}") from exc
    except BotoCoreError as exc:
        raise CommandError(f"cannot reach the stand-in: {exc}") from exc
    print(f"Updated context {context} in {path}")
    return 0


def run_exec_credential(args: argparse.Namespace) -> int:
    """Print the ExecCredential kubectl reads from its credential plugin."""
    from botocore.exceptions import BotoCoreError

    from sdcguard.infra.local.kubeconfig import exec_credential

    try:
        credential = exec_credential(args.cluster)
    except BotoCoreError as exc:
        raise CommandError(f"cannot sign an EKS token: {exc}") from exc
    print(json.dumps(credential))
    return 0
